/* Rollout traces of one learner step: each group the step trained, token by token, coloured by the version
 * that produced each token (how stale it was at the step) or by how far the worker's logprob of it is from the
 * learner's. Tokens and prompts come from untrusted workers: inserted as text only. */
"use strict";

(function () {
  const { api, query, poll, h, $, fmt, badge, setText, ApiError } = E2;
  const STALE = ["#dafbe1", "#ddf4ff", "#fff8c5", "#ffd8b5", "#ffcecb"];  // staleness 0, 1, 2, 3, 4+
  const PAGE = 16;

  function mismatch(t) {
    return t.behaviour_logprob === null || t.learner_logprob === null ? null
      : Math.abs(t.behaviour_logprob - t.learner_logprob);
  }

  function tokenSpan(t, step, mode) {
    const gap = mismatch(t);
    const staleness = step - t.version;
    const title = [`token ${t.id}`, `version ${t.version} (staleness ${staleness})`,
      `behaviour logprob ${fmt.num(t.behaviour_logprob, 4)}`, `learner logprob ${fmt.num(t.learner_logprob, 4)}`]
      .concat(t.model ? [] : ["an environment's token"]).join("\n");
    const el = h("span", { class: "tok" + (t.model ? "" : " env"), title,
      dataset: { version: t.version, mismatch: gap === null ? "" : gap.toFixed(4) } }, t.text);
    if (mode === "version") el.style.backgroundColor = STALE[Math.min(Math.max(staleness, 0), STALE.length - 1)];
    else if (gap !== null) el.style.backgroundColor = `rgba(207, 34, 46, ${Math.min(1, gap).toFixed(3)})`;
    return el;
  }

  function group(trace, step, mode) {
    const w = trace.worker;
    const audit = trace.audit ? badge(trace.audit.passed ? "passed" : "failed") : h("span", { class: "muted" }, "not audited");
    const head = h("dl", { class: "props" },
      h("dt", {}, "Worker"), h("dd", {}, h("a", { href: "/workers/" + encodeURIComponent(w.id) }, w.name || w.id), " ",
        w.trust ? h("span", { class: "badge s-" + w.trust, title: w.trust_reason || "" }, w.trust) : ""),
      h("dt", {}, "Version"), h("dd", {}, String(trace.version)),
      h("dt", {}, "Audit"), h("dd", {}, audit, trace.audit && trace.audit.reason ? " " + trace.audit.reason : ""),
      h("dt", {}, "Mean reward"), h("dd", {}, fmt.num(trace.reward_mean)),
      h("dt", {}, "Cost"), h("dd", {}, fmt.usd(trace.cost_usd)));
    const samples = trace.samples.map((s) => h("div", { class: "sample", dataset: { index: s.index } },
      h("p", { class: "muted" }, `sample ${s.index}: reward ${fmt.num(s.reward)}, ${s.tokens.length} tokens, ` +
        `${s.finish_reason}, largest mismatch ${fmt.num(s.max_abs_mismatch, 4)}`),
      h("p", { class: "tokens" }, s.tokens.map((t) => tokenSpan(t, step, mode)))));
    return h("section", { class: "card trace-group", id: "rollout-" + trace.id, dataset: { rollout: trace.id } },
      h("h2", {}, h("code", {}, trace.id), " ", badge(trace.status)),
      h("p", { class: "prompt" }, trace.prompt_text), head, samples);
  }

  E2.page("trace", () => {
    const root = $("#trace");
    const jobId = root.dataset.jobId;
    const step = Number(root.dataset.step);
    const colour = $("#trace-colour");
    const base = "/jobs/" + encodeURIComponent(jobId) + "/steps/";
    $("#trace-prev").href = base + Math.max(0, step - 1);
    $("#trace-prev").hidden = step === 0;
    $("#trace-next").href = base + (step + 1);
    $("#trace-controls").addEventListener("submit", (ev) => ev.preventDefault());
    let traces = [];

    function legend() {
      setText("#trace-legend", colour.value === "version"
        ? "Green: a token of the step's own version; blue, yellow, orange, red: 1, 2, 3, 4+ versions older."
        : "The redder a token, the further the worker's logprob of it from the learner's (full red: 1 nat or more); " +
          "uncoloured: not traced.");
    }

    function render() {
      const box = $("#trace-groups");
      box.replaceChildren(...traces.map((t) => group(t, step, colour.value)));
      legend();
    }

    async function load() {
      const job = await api("/v1/jobs/" + encodeURIComponent(jobId));
      setText("#trace-job", job.name);
      document.title = `Step ${step} · ${job.name} · Echo2`;
      $("#trace-next").hidden = step + 1 >= job.step;
      let page;
      try {
        page = await api(`/v1/jobs/${encodeURIComponent(jobId)}/traces` + query({ step, limit: PAGE }));
      } catch (err) {
        if (!(err instanceof ApiError) || err.status !== 410) throw err;
        traces = []; // retention deleted this ended job's tokens: there is nothing to draw, and the page says why
        setText("#trace-count", err.message);
        render();
        return;
      }
      traces = page.items;
      setText("#trace-count", page.total
        ? `${page.total} group${page.total === 1 ? "" : "s"} trained at step ${step}` +
          (page.total > traces.length ? ` (the first ${traces.length} shown)` : "")
        : `No group was trained at step ${step} (yet).`);
      render();
    }
    colour.addEventListener("change", render);
    poll(load, 10000);
  });
})();
