/* Submit-job form: builds a JobSpec from the fields that were filled in (empty = server default), posts it
 * with an Idempotency-Key, and shows the API's problem+json field errors next to the fields. */
"use strict";

E2.page("job-new", async () => {
  const { api, h, $, $$ } = E2;
  const form = $("#job-form"), summary = $("#form-errors"), taskSelect = $("#f-task");
  let tasks = [], required = new Set();
  let key = E2.idempotencyKey(); // one per logical submit, reused if the same body is retried

  const [taskList, datasets] = await Promise.all([api("/v1/tasks"), api("/v1/datasets?limit=200")]);
  tasks = taskList;
  taskSelect.replaceChildren(...tasks.map((t) => h("option", { value: t.name }, t.name)));
  if (tasks.some((t) => t.name === "arithmetic")) taskSelect.value = "arithmetic";
  $("#f-dataset").append(...datasets.items.map((d) => h("option", { value: d.id }, `${d.name} (${d.num_items} items)`)));
  taskSelect.addEventListener("change", renderTaskParams);
  renderTaskParams();
  form.addEventListener("input", () => { key = E2.idempotencyKey(); });

  /** Inputs for the chosen task's parameters, from the adapter's JSON schema (GET /v1/tasks). */
  function renderTaskParams() {
    const task = tasks.find((t) => t.name === taskSelect.value);
    $("#f-task-hint").textContent = task ? task.description + (task.needs_dataset ? " Needs a dataset." : "") : "";
    const box = $("#task-params");
    box.replaceChildren();
    const props = (task && task.params_schema && task.params_schema.properties) || {};
    const entries = Object.entries(props);
    if (!entries.length) return;
    required = new Set(task.params_schema.required || []);
    const fields = entries.map(([name, schema]) => paramField(name, schema));
    box.append(h("fieldset", {}, h("legend", {}, `Task parameters (${task.name})`), h("div", { class: "grid" }, fields)));
  }

  function paramField(name, schema) {
    const id = "tp-" + name.replace(/[^A-Za-z0-9_-]/g, "_");
    const type = schemaType(schema);
    const hintText = [schema.description, schema.default !== undefined ? `Default ${JSON.stringify(schema.default)}.` : ""]
      .filter(Boolean).join(" ");
    const common = { id, "data-field": "task.params." + name, "aria-describedby": `${id}-hint ${id}-error` };
    const label = (schema.title || name) + (required.has(name) ? " (required)" : "");
    if (type === "array" && schema.items && schema.items.enum) {
      // a set of choices: checkboxes in a group that carries the field name for error messages
      return h("fieldset", Object.assign({ class: "field choices", "data-kind": "list", tabindex: "-1" }, common),
        h("legend", {}, label),
        schema.items.enum.map((v, i) => h("div", { class: "field check" },
          h("input", { type: "checkbox", id: `${id}-${i}`, value: String(v) }),
          h("label", { for: `${id}-${i}` }, String(v)))),
        h("p", { class: "hint", id: id + "-hint" }, hintText || "Leave all unticked for the default."),
        h("p", { class: "field-error", id: id + "-error", hidden: true }));
    }
    let input;
    if (schema.enum || type === "boolean") {
      const values = schema.enum || [true, false];
      input = h("select", Object.assign({ "data-kind": type === "boolean" ? "bool" : "text" }, common),
        h("option", { value: "" }, "Default"), values.map((v) => h("option", { value: String(v) }, String(v))));
    } else if (type === "integer" || type === "number") {
      input = h("input", Object.assign({ type: "number", step: type === "integer" ? "1" : "any", "data-kind": "number",
        placeholder: schema.default ?? "" }, common));
    } else {
      input = h("input", Object.assign({ type: "text", "data-kind": "text", placeholder: schema.default ?? "" }, common));
    }
    return h("div", { class: "field" }, h("label", { for: id }, label), input,
      h("p", { class: "hint", id: id + "-hint" }, hintText),
      h("p", { class: "field-error", id: id + "-error", hidden: true }));
  }

  function schemaType(schema) {
    if (schema.type) return schema.type;
    const options = (schema.anyOf || []).map((s) => s.type).filter((t) => t && t !== "null");
    return options[0] || "string";
  }

  /** The JobSpec: only filled fields, nested by their dotted data-field path. */
  function spec() {
    const out = {};
    for (const el of $$("[data-field]", form)) {
      if (el.dataset.kind === "list") {
        const picked = $$("input:checked", el).map((c) => c.value);
        if (picked.length) setPath(out, el.dataset.field.split("."), picked);
        continue;
      }
      const raw = el.value.trim();
      if (raw === "" && !(el.type === "number" && el.validity.badInput)) continue;
      let value = raw;
      if (el.dataset.kind === "number") value = el.validity.badInput ? el.value : Number(raw);
      else if (el.dataset.kind === "bool") value = raw === "true";
      setPath(out, el.dataset.field.split("."), value);
    }
    return out;
  }

  function setPath(obj, path, value) {
    let node = obj;
    for (const part of path.slice(0, -1)) node = node[part] = node[part] || {};
    node[path[path.length - 1]] = value;
  }

  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const button = $("#submit-job");
    button.disabled = true;
    E2.clearErrors(form, summary);
    try {
      const job = await api("/v1/jobs", { method: "POST", body: spec(), headers: { "Idempotency-Key": key } });
      E2.announce(`Job ${job.name} submitted.`);
      location.assign("/jobs/" + encodeURIComponent(job.id));
    } catch (err) {
      if (!(err instanceof E2.ApiError)) throw err;
      E2.showErrors(form, err, summary);
      button.disabled = false;
    }
  });
});
