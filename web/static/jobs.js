/* Jobs list: status, progress, reward and cost, filtered by status and name; the fleet jobs of Tinker models (one
   per model that saved a sampler) only on request. Refreshed every 2 s. */
"use strict";

E2.page("jobs", () => {
  const { api, query, poll, h, $, fmt, timeEl, badge, fillRows } = E2;
  const PAGE = 20;
  const status = $("#filter-status"), name = $("#filter-name"), tinker = $("#filter-tinker");
  const params = new URLSearchParams(location.search);
  status.value = params.get("status") || "";
  name.value = params.get("name") || "";
  tinker.checked = params.get("tinker") === "true";
  let offset = 0, debounce = null;

  async function load() {
    const page = await api("/v1/jobs" + query({ limit: PAGE, offset, ...filters(), tinker: tinker.checked ? "" : false }));
    fillRows($("#jobs-table tbody"), page.items.map(row), emptyText(), 7);
    const last = Math.min(offset + page.items.length, page.total);
    E2.setText("#jobs-count", page.total ? `Jobs ${page.total ? offset + 1 : 0}–${last} of ${page.total}` : "");
    $("#jobs-prev").disabled = offset === 0;
    $("#jobs-next").disabled = page.next_offset === null || page.next_offset === undefined;
    $("#jobs-prev").parentElement.hidden = offset === 0 && $("#jobs-next").disabled;
  }

  function filters() {
    return { status: status.value, name: name.value.trim() };
  }

  function emptyText() {
    if (status.value || name.value) return "No jobs match these filters.";
    // Tinker samplers are jobs too: a user who has only those is told where they are.
    return tinker.checked ? "No jobs yet. Submit one to start training."
      : "No training jobs yet (Tinker samplers are hidden: tick \"Show Tinker samplers\"). Submit one to start training.";
  }

  function progress(job) {
    const max = job.spec.max_steps;
    if (job.kind === "tinker_fleet") return h("td", { class: "progress-cell" }, `checkpoint ${job.step}`);
    return h("td", { class: "progress-cell" },
      h("progress", { max, value: job.step, "aria-label": `${job.name}: step ${job.step} of ${max}` }),
      h("span", {}, ` ${job.step} / ${max}`));
  }

  function row(job) {
    return h("tr", { dataset: { key: job.id } },
      h("th", { scope: "row", class: "wrap" }, h("a", { href: "/jobs/" + encodeURIComponent(job.id) }, job.name)),
      h("td", {}, badge(job.status)),
      progress(job),
      h("td", { class: "num" }, fmt.num(job.reward_mean)),
      h("td", { class: "num" }, fmt.usd(job.cost.total_usd)),
      h("td", { class: "muted wrap" }, `${job.spec.base_model} · ${job.spec.task.name}`),
      h("td", {}, timeEl(job.created_at, true)));
  }

  function filtersChanged() {
    offset = 0;
    const q = query({ ...filters(), tinker: tinker.checked || "" });
    history.replaceState(null, "", location.pathname + q);
    poller.now();
  }

  status.addEventListener("change", filtersChanged);
  tinker.addEventListener("change", filtersChanged);
  name.addEventListener("input", () => { clearTimeout(debounce); debounce = setTimeout(filtersChanged, 250); });
  $("#job-filters").addEventListener("submit", (ev) => { ev.preventDefault(); filtersChanged(); });
  $("#jobs-prev").addEventListener("click", () => { offset = Math.max(0, offset - PAGE); poller.now(); });
  $("#jobs-next").addEventListener("click", () => { offset += PAGE; poller.now(); });
  const poller = poll(load);
});
