/* Job detail: summary, live charts from step metrics, versions, workers, the scheduler's activation
 * decisions, sample rollouts; cancel and checkpoint download.
 * Metrics are fetched incrementally (since_step) so each poll moves little data. */
"use strict";

E2.page("job", () => {
  const { api, query, poll, h, $, fmt, timeEl, badge, fillRows, setText, TERMINAL, ApiError } = E2;
  const id = $("#job").dataset.jobId;
  const base = "/v1/jobs/" + encodeURIComponent(id);
  const metrics = [];
  const openRollouts = new Set();
  const workerNames = new Map(); // worker id -> name, from the workers seen on this job
  const DECISIONS_SHOWN = 20;
  let job = null, versionsSeen = null, rolloutsSig = "", finalDone = false;

  const charts = makeCharts();

  async function load() {
    job = await api(base);
    renderJob();
    await Promise.all([loadMetrics(), loadEvals(), loadVersions(), loadWorkers().then(loadDecisions), loadRollouts(),
      loadReport()]);
    if (TERMINAL.has(job.status)) {
      if (finalDone) poller.stop();
      finalDone = true; // one more round after the end, then stop polling a job that cannot change
    }
  }

  // ---- job summary and actions ------------------------------------------------------------
  function renderJob() {
    const spec = job.spec;
    document.title = `${job.name} · Echo2`;
    setText("#job-name", job.name);
    $("#job-status").replaceWith(Object.assign(badge(job.status), { id: "job-status" }));
    const reason = $("#job-reason");
    reason.hidden = !job.status_reason;
    reason.textContent = job.status_reason || "";
    const traces = $("#job-traces");
    traces.hidden = job.step === 0;
    traces.href = `/jobs/${encodeURIComponent(job.id)}/steps/${Math.max(0, job.step - 1)}`;
    // A Tinker sampler has no steps of its own: it follows its model's sampler checkpoints until the model goes.
    const sampler = job.kind === "tinker_fleet";
    setText("#sum-step", sampler ? `sampling checkpoint ${job.step} of its Tinker model (no steps of its own)`
      : `${job.step} / ${spec.max_steps} steps `);
    Object.assign($("#sum-progress"), { max: spec.max_steps, value: job.step, hidden: sampler });
    setText("#sum-reward", fmt.num(job.reward_mean));
    $("#sum-cost").replaceChildren(fmt.usd(job.cost.total_usd), h("small", { class: "muted" },
      `learner ${fmt.usd(job.cost.learner_usd)} · workers ${fmt.usd(job.cost.workers_usd)}`));
    setText("#sum-version", job.final_version !== null && job.final_version !== undefined
      ? `${job.version} (final checkpoint: ${job.final_version})` : job.version ?? "none yet");
    setText('#ckpt-version option[value=""]', defaultCheckpoint());
    setText("#sum-model", spec.base_model);
    const params = Object.entries(spec.task.params || {}).map(([k, v]) => `${k}=${v}`).join(", ");
    setText("#sum-task", spec.task.name + (params ? ` (${params})` : ""));
    setText("#sum-staleness", `S = ${spec.staleness} · κ = ${spec.publish_period}`);
    setText("#sum-prompts", `${job.num_prompts} · G = ${spec.grpo.group_size} · ${spec.grpo.prompts_per_step}/step`);
    $("#sum-started").replaceChildren(...(job.finished_at ? ["finished ", timeEl(job.finished_at, true)]
      : job.started_at ? ["started ", timeEl(job.started_at, true)] : ["not started"]));
    $("#cancel").hidden = TERMINAL.has(job.status);
    $("#budget-form").hidden = TERMINAL.has(job.status);
    $("#resume").hidden = !(job.status === "paused" && job.paused_for === "reward");
    const budget = $("#budget-usd");
    if (document.activeElement !== budget) budget.value = spec.budget_usd ?? "";
    $("#download").disabled = job.version === null || job.version === undefined;
  }

  /** What cancelling keeps: retention (api/services/retention.py, README "Operating") deletes at once every version
   * of an ended job but its newest and those the server keeps as checkpoints (ECHO2_KEEP_VERSIONS_EVERY). */
  function cancelText() {
    const stops = `“${job.name}” stops training now`;
    if (job.version === null || job.version === undefined) return `${stops}. This cannot be undone.`;
    return `${stops}. Its newest version (now ${job.version}) stays downloadable; earlier versions are deleted ` +
      "unless the server keeps them as checkpoints (ECHO2_KEEP_VERSIONS_EVERY): download any you want first. " +
      "This cannot be undone.";
  }

  $("#cancel").addEventListener("click", async () => {
    const ok = await E2.confirmAction("Cancel this job?", cancelText(), "Cancel job");
    if (!ok) return;
    try {
      job = await api(base + "/cancel", { method: "POST" });
      renderJob();
      E2.announce(`Job ${job.name} cancelled.`);
      $("#download").focus();
    } catch (err) {
      setText("#download-status", "Could not cancel: " + err.message);
    }
    poller.now();
  });

  // A job its task paused (its groups could not be scored) is resumed by its owner once the task is fixed.
  $("#resume").addEventListener("click", async () => {
    try {
      job = await api(base + "/resume", { method: "POST" });
      renderJob();
      E2.announce(`Job ${job.name} resumed: it is ${job.status}.`);
    } catch (err) {
      setText("#download-status", "Could not resume: " + err.message);
    }
    poller.now();
  });

  // Raising the budget of a job its budget paused queues it again (PATCH /v1/jobs/{id}).
  $("#budget-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    const raw = $("#budget-usd").value.trim();
    try {
      job = await api(base, { method: "PATCH", body: { budget_usd: raw === "" ? null : Number(raw) } });
      renderJob();
      E2.announce(`Budget of ${job.name} set to ${raw === "" ? "none" : "$" + raw}; the job is ${job.status}.`);
    } catch (err) {
      setText("#download-status", "Could not set the budget: " + err.message);
    }
    poller.now();
  });

  $("#download").addEventListener("click", async () => {
    // The API needs the bearer token, so a plain link cannot work: stream it, then save the blob.
    const button = $("#download");
    const version = $("#ckpt-version").value;
    button.disabled = true;
    setText("#download-status", "Downloading checkpoint…");
    try {
      const response = await api(base + "/checkpoint" + query({ version }), { raw: true });
      const name = filename(response.headers.get("Content-Disposition")) || `${id}.tar`;
      const reader = response.body.getReader();
      const parts = [];
      let received = 0;
      for (;;) {
        const { done, value } = await reader.read();
        if (done) break;
        parts.push(value);
        received += value.length;
        setText("#download-status", `Downloading checkpoint… ${fmt.bytes(received)}`);
      }
      const url = URL.createObjectURL(new Blob(parts, { type: "application/x-tar" }));
      const a = h("a", { href: url, download: name, hidden: true });
      document.body.append(a);
      a.click();
      a.remove();
      setTimeout(() => URL.revokeObjectURL(url), 60_000);
      setText("#download-status", `Saved ${name} (${fmt.bytes(received)}).`);
    } catch (err) {
      setText("#download-status", "Download failed: " + err.message);
    } finally {
      button.disabled = false;
    }
  });

  /** What the API sends without ?version=: the final checkpoint once there is one, else the latest. */
  function defaultCheckpoint() {
    const final = job && job.final_version;
    return final !== null && final !== undefined ? `Final (version ${final})` : "Latest published";
  }

  function filename(disposition) {
    const m = /filename="([^"]+)"/.exec(disposition || "");
    return m ? m[1] : null;
  }

  // ---- metrics and charts -----------------------------------------------------------------
  async function loadMetrics() {
    for (;;) {
      const since = metrics.length ? metrics[metrics.length - 1].step + 1 : 0;
      const got = await api(base + "/metrics" + query({ since_step: since, limit: 1000 }));
      metrics.push(...got);
      if (got.length < 1000) break;
    }
    drawCharts();
  }

  async function loadEvals() {
    const evals = await api(base + "/evals");
    charts.heldout.set([evals.map((e) => e.step), evals.map((e) => e.greedy_accuracy), evals.map((e) => e.sampled_accuracy)]);
  }

  function makeCharts() {
    const fig = (name) => $(`figure[data-chart="${name}"]`);
    const pct = (v) => (v === null || v === undefined ? "–" : (100 * v).toFixed(0) + "%");
    return {
      reward: E2Charts.line(fig("reward"), {
        series: [
          { label: "mean reward", color: "#1f6feb" },
          { label: "+1 std", color: "#93b4e8", width: 1, dash: [4, 4] },
          { label: "−1 std", color: "#93b4e8", width: 1, dash: [4, 4] },
        ],
        bands: [{ series: [2, 3], fill: "rgba(31, 111, 235, 0.12)" }],
      }),
      heldout: E2Charts.line(fig("heldout"), {
        series: [{ label: "greedy", color: "#1f6feb" }, { label: "sampled", color: "#93b4e8", dash: [4, 4] }],
        y: { min: 0, max: 1 }, format: pct,
      }),
      util: E2Charts.line(fig("util"), { series: [{ label: "utilisation", color: "#15803d" }], y: { min: 0, max: 1 }, format: pct }),
      rps: E2Charts.line(fig("rps"), { series: [{ label: "groups/s", color: "#7c3aed" }], y: { min: 0 } }),
      kl: E2Charts.line(fig("kl"), {
        series: [{ label: "KL", color: "#c2410c" }, { label: "clip fraction", color: "#0e7490", scale: "y2" }],
      }),
      mismatch: E2Charts.line(fig("mismatch"), {
        series: [
          { label: "mismatch KL", color: "#c2410c" },
          { label: "KL, fresh (t − x = 0)", color: "#f59e0b", width: 1, dash: [4, 4] },
          { label: "ESS", color: "#1f6feb", scale: "y2" },
          { label: "clipped", color: "#0e7490", scale: "y2", dash: [2, 3] },
          { label: "masked", color: "#7c3aed", scale: "y2", dash: [6, 3] },
        ],
        y: { min: 0 },
      }),
      cost: E2Charts.line(fig("cost"), {
        series: [{ label: "total USD", color: "#b91c1c" }], time: true, y: { min: 0 },
        format: (v) => (v === null || v === undefined ? "–" : "$" + Number(v.toPrecision(3))),
      }),
    };
  }

  function drawCharts() {
    const steps = metrics.map((m) => m.step);
    const col = (f) => metrics.map(f);
    const plus = (m) => (m.reward_mean === null || m.reward_std === null ? null : m.reward_mean + m.reward_std);
    const minus = (m) => (m.reward_mean === null || m.reward_std === null ? null : m.reward_mean - m.reward_std);
    charts.reward.set([steps, col((m) => m.reward_mean), col(plus), col(minus)]);
    charts.util.set([steps, col((m) => m.learner_utilization)]);
    charts.rps.set([steps, col((m) => m.rollouts_per_s)]);
    charts.kl.set([steps, col((m) => m.kl), col((m) => m.clip_frac)]);
    // mismatch rows: one per staleness, then the whole step's (staleness -1)
    const mm = (m, s, key) => { const r = (m.mismatch || []).find((x) => x.staleness === s); return r ? r[key] : null; };
    charts.mismatch.set([steps, col((m) => mm(m, -1, "kl")), col((m) => mm(m, 0, "kl")), col((m) => mm(m, -1, "ess")),
      col((m) => mm(m, -1, "clipped")), col((m) => mm(m, -1, "masked"))]);
    const costed = metrics.filter((m) => m.cost_usd !== null);
    charts.cost.set([costed.map((m) => new Date(m.created_at).getTime() / 1000), costed.map((m) => m.cost_usd)]);
    drawStaleness();
  }

  function drawStaleness() {
    const counts = [];
    for (const m of metrics) m.staleness_hist.forEach((n, k) => { counts[k] = (counts[k] || 0) + n; });
    const total = counts.reduce((a, b) => a + (b || 0), 0);
    const fig = $('figure[data-chart="staleness"]');
    fig.dataset.points = String(total);
    const rows = Array.from(counts, (n, k) => h("tr", { dataset: { key: String(k) } },
      h("th", { scope: "row" }, String(k)),
      h("td", { class: "num" }, String(n || 0)),
      h("td", {}, h("meter", { min: 0, max: Math.max(total, 1), value: n || 0, "aria-label": `staleness ${k}` }))));
    fillRows($("#staleness-hist tbody"), rows, "No trained rollouts yet.", 3);
  }

  // ---- versions ---------------------------------------------------------------------------
  /** Time until every targeted worker held the version; the API sends null while some still fetch. */
  function dissemination(v, slowest) {
    if (v.dissemination_s !== null && v.dissemination_s !== undefined) {
      return [h("meter", { min: 0, max: slowest, value: v.dissemination_s, "aria-hidden": "true" }),
        " ", fmt.secs(v.dissemination_s)];
    }
    return [v.workers_targeted ? "spreading…" : "no worker active"];
  }

  async function loadVersions() {
    const versions = await api(base + "/versions");
    const slowest = Math.max(0.001, ...versions.map((v) => v.publish_seconds || 0));
    const slowestSpread = Math.max(0.001, ...versions.map((v) => v.dissemination_s || 0));
    const rows = versions.slice().reverse().map((v) => h("tr", { dataset: { key: String(v.version) } },
      h("th", { scope: "row", class: "num" }, String(v.version)),
      h("td", { class: "num" }, String(v.step)),
      h("td", { class: "num" }, !v.available
        ? h("span", { class: "muted", title: "Weights deleted: no rollout can use them and they are not a kept checkpoint" },
          "deleted")
        : v.total_size === null ? h("span", { class: "muted" }, "delta only")
          : [fmt.bytes(v.total_size), v.adapter ? " adapter" : ""]),
      h("td", { class: "num" }, v.available && v.delta_size !== null ? fmt.bytes(v.delta_size) : "–"),
      h("td", { class: "bar-cell" },
        h("meter", { min: 0, max: slowest, value: v.publish_seconds || 0, "aria-hidden": "true" }),
        " ", fmt.secs(v.publish_seconds)),
      h("td", { class: "num" }, `${v.workers_holding} · ${v.workers_targeted}`),
      h("td", { class: "bar-cell" }, ...dissemination(v, slowestSpread)),
      h("td", {}, timeEl(v.created_at, true))));
    fillRows($("#versions-table tbody"), rows, "No version published yet.", 8);
    const stored = versions.filter((v) => v.available && v.total_size !== null);  // a delta only: no download
    const storedKey = stored.map((v) => v.version).join();
    if (storedKey !== versionsSeen) {
      versionsSeen = storedKey;
      const select = $("#ckpt-version");
      const chosen = select.value;
      select.replaceChildren(h("option", { value: "" }, defaultCheckpoint()),
        ...stored.reverse().map((v) => h("option", { value: String(v.version) }, `Version ${v.version} (step ${v.step})`)));
      select.value = chosen;
    }
  }

  // ---- utilisation and waste ----------------------------------------------------------------
  async function loadReport() {
    const r = await api(base + "/report");
    const pct = (x) => (x === null || x === undefined ? "–" : `${(100 * x).toFixed(1)}%`);
    setText("#rep-util", `${pct(r.learner_utilization)} of ${fmt.num(r.learner_wall_s, 0)} s`);
    setText("#rep-generated", String(r.rollouts.generated));
    const left = r.rollouts.unused ? `${r.rollouts.unused} never trained (the job ended)` : String(r.rollouts.waiting);
    setText("#rep-trained", `${r.rollouts.trained} · ${left}`);
    setText("#rep-stale", pct(r.stale_fraction));
    const kinds = Object.entries(r.rollouts.rejected);
    setText("#rep-rejected", kinds.length ? kinds.map(([k, n]) => `${k.replaceAll("_", " ")} ${n}`).join(", ") : "none");
    setText("#rep-audits", `${r.audits} (${r.audits_failed})`);
  }

  // ---- workers ----------------------------------------------------------------------------
  async function loadWorkers() {
    const page = await api("/v1/workers" + query({ job_id: id, limit: 100 }));
    for (const w of page.items) workerNames.set(w.id, w.name);
    fillRows($("#workers-table tbody"), page.items.map(E2.workerRow), "No worker is assigned to this job.", 11);
  }

  // ---- activation decisions ---------------------------------------------------------------
  async function loadDecisions() {
    const decisions = await api(base + "/decisions" + query({ limit: DECISIONS_SHOWN }));
    fillRows($("#decisions-table tbody"), decisions.map(decisionRow), "No activation decision yet.", 5);
  }

  function decisionRow(d) {
    const name = workerNames.get(d.worker_id);
    return h("tr", { dataset: { key: `${d.created_at}|${d.worker_id}|${d.action}|${d.repeats}` } },
      h("td", {}, timeEl(d.decided_at || d.created_at, true)),
      h("td", {}, badge(d.action)),
      h("td", {}, h("a", { href: "/workers/" + encodeURIComponent(d.worker_id), title: d.worker_id },
        name || h("code", {}, d.worker_id.slice(0, 12)))),
      h("td", { class: "wrap" }, d.repeats > 1 ? `${d.line} (x${d.repeats} since ${d.created_at.slice(11, 19)})`
        : d.line),
      h("td", { class: "wrap muted" }, d.trigger));
  }

  // ---- sample rollouts --------------------------------------------------------------------
  $("#rollout-status").addEventListener("change", () => { rolloutsSig = ""; poller.now(); });

  async function loadRollouts() {
    let page;
    try {
      page = await api(base + "/rollouts" + query({ limit: 10, status: $("#rollout-status").value }));
    } catch (err) {
      if (!(err instanceof ApiError) || err.status !== 410) throw err;
      // Retention deleted the tokens of an ended job: say so here; the rest of the page still loads.
      rolloutsSig = "";
      $("#rollouts").replaceChildren(h("li", { class: "empty muted" }, err.message));
      return;
    }
    const sig = JSON.stringify(page.items.map((r) => [r.id, r.status, r.rewards]));
    if (sig === rolloutsSig) return; // unchanged: keep the reader's place and open completions
    rolloutsSig = sig;
    const list = $("#rollouts");
    list.replaceChildren(...page.items.map(rollout));
    if (!page.items.length) list.append(h("li", { class: "empty muted" }, "No rollouts yet."));
  }

  function rollout(r) {
    const rewards = r.rewards || [];
    const details = h("details", { open: openRollouts.has(r.id) },
      h("summary", {}, `${r.completions.length} completion${r.completions.length === 1 ? "" : "s"}`,
        rewards.length ? ` · rewards ${rewards.map((x) => fmt.num(x, 2)).join(", ")}` : " · not scored yet"),
      h("ol", { class: "completions" }, r.completions.map((text, i) => h("li", {},
        h("pre", {}, text),
        h("p", { class: "muted" }, "reward ", rewards[i] === undefined || rewards[i] === null ? "–" : fmt.num(rewards[i], 3))))));
    details.addEventListener("toggle", () => (details.open ? openRollouts.add(r.id) : openRollouts.delete(r.id)));
    return h("li", { class: "rollout", dataset: { key: r.id } },
      h("div", { class: "rollout-meta" },
        badge(r.status), ` version ${r.version}`,
        r.trained_step !== null ? [" · trained at step ", h("a", {
          href: `/jobs/${encodeURIComponent(r.job_id)}/steps/${r.trained_step}#rollout-${encodeURIComponent(r.id)}`,
          title: "Its trace, token by token" }, String(r.trained_step))] : "",
        " · worker ", h("a", { href: "/workers/" + encodeURIComponent(r.worker_id) }, h("code", {}, r.worker_id.slice(0, 12))),
        " · ", timeEl(r.created_at, true)),
      r.reason ? h("p", { class: "muted" }, r.reason) : null,
      h("p", { class: "prompt" }, h("span", { class: "label" }, "Prompt "), r.prompt_text),
      details);
  }

  const poller = poll(load);
});
