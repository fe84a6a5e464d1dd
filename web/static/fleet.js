/* The rollout plane as people see it: the workers list, one worker, and a provider's own page. */
"use strict";

(function () {
  const { api, query, poll, h, $, fmt, timeEl, badge, fillRows, setText } = E2;

  E2.page("workers", (session) => {
    const PAGE = 50;
    const status = $("#worker-status");
    let offset = 0;
    if (session.kind === "provider") setText("#workers-scope", "Your machines.");
    else if (session.role === "admin") setText("#workers-scope", "The whole fleet (you are an admin).");
    else setText("#workers-scope", "The workers serving your jobs.");

    async function load() {
      const page = await api("/v1/workers" + query({ status: status.value, limit: PAGE, offset }));
      fillRows($("#workers-table tbody"), page.items.map(E2.workerRow), "No workers to show.", 11);
      setText("#workers-count", page.total ? `Workers ${offset + 1}–${offset + page.items.length} of ${page.total}` : "");
      $("#workers-prev").disabled = offset === 0;
      $("#workers-next").disabled = page.next_offset === null || page.next_offset === undefined;
    $("#workers-prev").parentElement.hidden = offset === 0 && $("#workers-next").disabled;
    }
    status.addEventListener("change", () => { offset = 0; poller.now(); });
    $("#worker-filters").addEventListener("submit", (ev) => ev.preventDefault());
    $("#workers-prev").addEventListener("click", () => { offset = Math.max(0, offset - PAGE); poller.now(); });
    $("#workers-next").addEventListener("click", () => { offset += PAGE; poller.now(); });
    const poller = poll(load);
  });

  E2.page("worker", (session) => {
    const id = $("#worker").dataset.workerId;
    // The evidence is its provider's and admins' to read: a job owner's browser does not ask (a 403).
    const seesAudits = session.kind !== "user" || session.role === "admin";
    async function load() {
      const w = await api("/v1/workers/" + encodeURIComponent(id));
      document.title = `${w.name} · Echo2`;
      setText("#worker-name", w.name);
      $("#worker-status").replaceWith(Object.assign(badge(w.status), { id: "worker-status" }));
      const trust = $("#worker-trust");
      const flags = [];
      if (!["probation", "trusted"].includes(w.trust)) flags.push(`${w.trust[0].toUpperCase()}${w.trust.slice(1)}: ${w.trust_reason}`);
      if (w.bad_chunks) flags.push(`${w.bad_chunks} chunk(s) served by this worker failed sha256 verification at its peers.`);
      trust.hidden = !flags.length;
      trust.textContent = flags.join(" ");
      props("#worker-audits", [
        ["Trust", badge(w.trust)],
        ["Audits passed", String(w.audits_passed)],
        ["Audits failed", String(w.audits_failed)],
        ["Quarantined until", w.quarantined_until ? timeEl(w.quarantined_until) : "–"],
        ["Latest evidence", w.trust_reason || "–"],
      ]);
      if (seesAudits) await failedAudits(id);  // else its box stays hidden
      props("#worker-hw", [
        ["GPU", w.gpu_count ? `${w.gpu_count} × ${w.gpu_model}` : w.gpu_model],
        ["VRAM", `${fmt.num(w.vram_gb, 1)} GB`],
        ["Price", `${fmt.usd(w.price_per_hour)} / h`],
        ["Region", w.region],
        ["Backends", w.backends.join(", ")],
        ["Provider", h("code", {}, w.provider_id)],
        ["Registered", timeEl(w.created_at)],
      ]);
      const placed = seesAudits ? await placement(id) : null;
      props("#worker-work", [
        ["Status", [badge(w.status), ` (told: ${w.desired})`]],
        ["Job", w.job_id ? E2.jobRef(w.job_id, true) : "none"],
        ["Version held", w.version_held ?? "none"],
        ["Throughput μ", `${fmt.num(w.rollouts_per_s)} groups/s`],
        ["Rollouts accepted", String(w.accepted_rollouts)],
        ["Rollouts rejected", String(w.rejected_rollouts)],
        ["Last heartbeat", timeEl(w.last_heartbeat_at, true)],
        ...(placed ? [["Scheduler", placed]] : []),
      ]);
      props("#worker-net", [
        ["Relay role", w.relay_url ? "relay (serves chunks to peers)" : "leaf (downloads only)"],
        ["Relay URL", w.relay_url ? h("code", {}, w.relay_url) : "–"],
        ["Upload", `${fmt.num(w.upload_mbps, 0)} Mbit/s`],
        ["Download", `${fmt.num(w.download_mbps, 0)} Mbit/s`],
        ["Bad chunks served", String(w.bad_chunks)],
      ]);
    }
    poll(load);
  });

  /** The failed audits behind the trust state; only the worker's provider and admins may read them. */
  async function failedAudits(id) {
    const list = $("#worker-failed-audits"), box = list.closest("div");
    let audits;
    try { audits = await api(`/v1/workers/${encodeURIComponent(id)}/audits?passed=false&limit=20`); }
    catch (_) { box.hidden = true; return; }
    box.hidden = false;
    fillRows(list, audits.map((a) => h("tr", {},
      h("td", {}, timeEl(a.created_at, true)), h("td", {}, E2.jobRef(a.job_id)),
      h("td", { class: "num" }, String(a.version)), h("td", {}, a.reason || ""))), "No failed audits.", 4);
  }

  /** The scheduler's newest line on each job it weighed the worker for: why it works where it does, or idles
   * ("skipped …: VRAM 8 GiB < need 11.5 GiB"). Only the worker's provider and admins may read them. */
  async function placement(id) {
    let lines;
    try { lines = await api(`/v1/workers/${encodeURIComponent(id)}/placement`); }
    catch (_) { return null; }
    return lines.length ? lines.map((p) => h("div", { class: "placement" }, p.line)) : "no decision yet";
  }

  function props(sel, pairs) {
    $(sel).replaceChildren(...pairs.flatMap(([k, v]) => [h("dt", {}, k), h("dd", {}, v)]));
  }

  E2.page("provider", (session) => {
    if (session.kind !== "provider") {
      const note = $("#provider-note");
      note.hidden = false;
      note.textContent = "This page is for GPU providers: log out and log in with your provider token (e2p_…).";
      return;
    }
    $("#provider-body").hidden = false;
    /** The provider's registered workers, every page: each restart of a machine leaves a deregistered row, and
     * hundreds of those must not push its live ones off the page. */
    async function liveWorkers() {
      const workers = [];
      for (let offset = 0; offset !== null && offset !== undefined;) {
        const page = await api("/v1/workers" + query({ include_deregistered: false, limit: 500, offset }));
        workers.push(...page.items);
        offset = page.next_offset;
      }
      return workers;
    }
    async function load() {
      const [me, workers] = await Promise.all([api("/v1/providers/me"), liveWorkers()]);
      setText("#provider-name", me.name);
      document.title = `${me.name} · Echo2`;
      setText("#prov-earnings", fmt.usd(me.earnings_usd));
      setText("#prov-workers", String(me.num_workers));
      const active = workers.filter((w) => w.status === "active");
      setText("#prov-active", String(active.length));
      setText("#prov-price", fmt.usd(active.reduce((a, w) => a + w.price_per_hour, 0)) + " / h while active");
      setText("#prov-contact", me.contact || "–");
      fillRows($("#workers-table tbody"), workers.map(E2.workerRow), "No workers yet.", 11);
    }
    poll(load);
  });
})();
