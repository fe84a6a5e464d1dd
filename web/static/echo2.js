/* Echo2 dashboard core: session, API client, polling, DOM helpers and formatting.
 * Every page script uses window.E2. Data from the API is only ever inserted as text (never innerHTML):
 * prompts and completions come from untrusted workers. */
"use strict";

(function () {
  const SESSION_KEY = "echo2.session";
  const POLL_MS = 2000;

  // ---- session ------------------------------------------------------------------------------
  const session = {
    get() {
      try { return JSON.parse(sessionStorage.getItem(SESSION_KEY) || "null"); } catch (_) { return null; }
    },
    set(value) { sessionStorage.setItem(SESSION_KEY, JSON.stringify(value)); },
    clear() { sessionStorage.removeItem(SESSION_KEY); },
  };

  function toLogin() {
    const here = location.pathname + location.search;
    location.replace("/login" + (here && here !== "/login" ? "?next=" + encodeURIComponent(here) : ""));
  }

  // ---- API client ---------------------------------------------------------------------------
  class ApiError extends Error {
    constructor(status, body) {
      super((body && (body.detail || body.title)) || `HTTP ${status}`);
      this.status = status;
      this.errors = (body && Array.isArray(body.errors)) ? body.errors : [];
    }
  }

  /** Call an API route with the session's bearer token. Returns parsed JSON (or the Response with raw). */
  async function api(path, opts = {}) {
    const s = opts.key ? { key: opts.key } : session.get();
    if (!s) { toLogin(); throw new ApiError(401, { detail: "not logged in" }); }
    const headers = Object.assign({ Authorization: "Bearer " + s.key, Accept: "application/json" }, opts.headers || {});
    const init = { method: opts.method || "GET", headers, signal: opts.signal };
    if (opts.body !== undefined) {
      headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(opts.body);
    }
    let response;
    try {
      response = await fetch(path, init);
    } catch (err) {
      if (err.name === "AbortError") throw err;
      connection(false);
      throw new ApiError(0, { detail: "cannot reach the server" });
    }
    connection(true);
    if (response.status === 401 && !opts.key) {
      session.clear();
      toLogin();
    }
    if (!response.ok) {
      let body = null;
      try { body = await response.json(); } catch (_) { /* not problem+json */ }
      throw new ApiError(response.status, body);
    }
    if (opts.raw) return response;
    if (response.status === 204) return null;
    return response.json();
  }

  function query(params) {
    const q = new URLSearchParams();
    for (const [k, v] of Object.entries(params)) if (v !== "" && v !== null && v !== undefined) q.set(k, v);
    const s = q.toString();
    return s ? "?" + s : "";
  }

  function connection(ok) {
    const el = document.getElementById("conn");
    if (!el) return;
    el.hidden = ok;
    if (!ok) el.textContent = "Cannot reach the Echo2 server. Retrying…";
  }

  // ---- polling that pauses in hidden tabs ---------------------------------------------------
  /** Run fn now and every `ms` after it settles; paused while the tab is hidden. */
  function poll(fn, ms = POLL_MS) {
    let timer = null, running = false, again = false, stopped = false;
    async function tick() {
      clearTimeout(timer);
      timer = null;
      if (stopped || document.hidden) return;
      if (running) { again = true; return; }
      running = true;
      try {
        await fn();
        pageError(null);
      } catch (err) {
        if (!(err instanceof ApiError)) report(err);
        else if (err.status !== 0 && err.status !== 401) pageError(err);
      }
      running = false;
      if (again) { again = false; tick(); } else schedule();
    }
    function schedule() {
      if (!stopped && !document.hidden && timer === null) timer = setTimeout(tick, ms);
    }
    function onVisibility() {
      if (document.hidden) { clearTimeout(timer); timer = null; } else tick();
    }
    document.addEventListener("visibilitychange", onVisibility);
    tick();
    return {
      now: tick,
      stop() { stopped = true; clearTimeout(timer); document.removeEventListener("visibilitychange", onVisibility); },
    };
  }

  function report(err) {
    // A bug in the page, not an API answer: say so where a person (and the browser tests) will see it.
    const el = document.getElementById("conn");
    if (el) { el.hidden = false; el.textContent = "Something went wrong on this page: " + err.message; }
    console.error(err);
  }

  // ---- DOM helpers --------------------------------------------------------------------------
  /** h("a", {href: "/x", class: "y"}, "text", child) — children are nodes or text, never HTML. */
  function h(tag, attrs, ...children) {
    const el = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") el.className = v;
      else if (k === "dataset") Object.assign(el.dataset, v);
      else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
      else if (v === true) el.setAttribute(k, "");
      else el.setAttribute(k, String(v));
    }
    append(el, children);
    return el;
  }

  function append(el, children) {
    for (const c of children.flat()) {
      if (c === null || c === undefined || c === false) continue;
      el.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
  }

  const $ = (sel, root = document) => root.querySelector(sel);
  const $$ = (sel, root = document) => Array.from(root.querySelectorAll(sel));

  function setText(sel, text) { const el = typeof sel === "string" ? $(sel) : sel; if (el) el.textContent = text; }

  /** Replace a table body's rows, keeping keyboard focus on the same control of the same row (rows carry
   * data-key), so a refresh every 2 s never throws a keyboard user back to the top of the page. */
  function fillRows(tbody, rows, emptyText, columns) {
    const active = document.activeElement;
    let key = null, index = -1;
    if (active && tbody.contains(active)) {
      const tr = active.closest("tr");
      key = tr && tr.dataset.key;
      index = $$("a, button, input, select, summary", tr).indexOf(active);
    }
    tbody.replaceChildren();
    if (!rows.length) {
      tbody.append(h("tr", {}, h("td", { colspan: columns, class: "empty" }, emptyText)));
      return;
    }
    tbody.append(...rows);
    if (key !== null && index >= 0) {
      const tr = rows.find((r) => r.dataset.key === key);
      const target = tr && $$("a, button, input, select, summary", tr)[index];
      if (target) target.focus();
    }
  }

  function announce(text) { setText("#live", ""); setTimeout(() => setText("#live", text), 50); }

  /** A modal confirmation (native <dialog>: focus-trapped, Esc closes). Resolves true on confirm. */
  function confirmAction(title, text, confirmLabel) {
    const dialog = $("#confirm");
    setText("#confirm-title", title);
    setText("#confirm-text", text);
    setText("#confirm-yes", confirmLabel || "Confirm");
    return new Promise((resolve) => {
      dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok"), { once: true });
      dialog.returnValue = "";
      dialog.showModal();
      $("#confirm-no").focus();
    });
  }

  /** Show API field errors next to inputs carrying data-field; the rest go to the summary list. */
  function showErrors(form, err, summary) {
    clearErrors(form, summary);
    const unplaced = [];
    const list = err.errors.length ? err.errors : [{ field: "", reason: err.message }];
    let first = null;
    for (const e of list) {
      const field = String(e.field || "").replace(/^(body|query|path)\./, "");
      const input = field && form.querySelector(`[data-field="${CSS.escape(field)}"]`);
      if (input) {
        const msg = document.getElementById(input.id + "-error");
        if (msg) { msg.textContent = e.reason; msg.hidden = false; }
        input.setAttribute("aria-invalid", "true");
        const details = input.closest("details");
        if (details) details.open = true;
        first = first || input;
        if (summary) unplaced.push({ text: e.reason, label: labelOf(input), target: input });
      } else {
        unplaced.push({ text: field && field !== "body" ? `${field}: ${e.reason}` : e.reason });
      }
    }
    if (summary) {
      const ul = $("ul", summary);
      ul.replaceChildren(...unplaced.map((u) => h("li", {},
        u.target ? h("a", { href: "#" + u.target.id, onclick: (ev) => { ev.preventDefault(); u.target.focus(); } },
          `${u.label}: ${u.text}`) : u.text)));
      summary.hidden = false;
      summary.focus();
    } else {
      const loose = unplaced.filter((u) => !u.target);
      if (loose.length) form.prepend(h("p", { class: "form-error", role: "alert" }, loose.map((u) => u.text).join(" ")));
      if (first) first.focus();
    }
    return unplaced;
  }

  function clearErrors(form, summary) {
    for (const el of $$("[aria-invalid]", form)) el.removeAttribute("aria-invalid");
    for (const el of $$(".field-error", form)) { el.textContent = ""; el.hidden = true; }
    for (const el of $$(".form-error", form)) el.remove();
    if (summary) summary.hidden = true;
  }

  function labelOf(input) {
    const label = document.querySelector(`label[for="${CSS.escape(input.id)}"]`);
    return label ? label.textContent.trim() : input.id;
  }

  // ---- formatting ---------------------------------------------------------------------------
  const fmt = {
    num(v, digits = 3) {
      if (v === null || v === undefined || Number.isNaN(v)) return "–";
      if (v !== 0 && Math.abs(v) < 10 ** -digits) return v.toExponential(1);
      return Number(v).toLocaleString(undefined, { maximumFractionDigits: digits });
    },
    usd(v) {
      if (v === null || v === undefined) return "–";
      return "$" + Number(v).toLocaleString(undefined, { minimumFractionDigits: 2, maximumFractionDigits: v < 1 ? 4 : 2 });
    },
    pct(v) { return v === null || v === undefined ? "–" : (100 * v).toFixed(0) + "%"; },
    bytes(n) {
      if (n === null || n === undefined) return "–";
      const units = ["B", "KB", "MB", "GB", "TB"];
      let i = 0;
      while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
      return (i ? n.toFixed(1) : n) + " " + units[i];
    },
    secs(v) {
      if (v === null || v === undefined) return "–";
      return v < 1 ? (v * 1000).toFixed(0) + " ms" : v < 120 ? v.toFixed(1) + " s" : (v / 60).toFixed(1) + " min";
    },
    date(iso) {
      if (!iso) return "–";
      return new Date(iso).toLocaleString(undefined, { dateStyle: "medium", timeStyle: "short" });
    },
    ago(iso) {
      if (!iso) return "never";
      const s = Math.max(0, (Date.now() - new Date(iso).getTime()) / 1000);
      if (s < 60) return Math.round(s) + " s ago";
      if (s < 3600) return Math.round(s / 60) + " min ago";
      if (s < 86400) return Math.round(s / 3600) + " h ago";
      return fmt.date(iso);
    },
  };

  function timeEl(iso, relative) {
    if (!iso) return "–";
    return h("time", { datetime: iso, title: new Date(iso).toISOString() }, relative ? fmt.ago(iso) : fmt.date(iso));
  }

  function badge(status) { return h("span", { class: "badge s-" + status }, status); }

  const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);

  /** A job id, linked for users (providers cannot open jobs: the API keeps them to their owners). */
  function jobRef(jobId, full) {
    if (!jobId) return "–";
    const code = h("code", { title: jobId }, full ? jobId : jobId.slice(0, 12));
    const s = session.get();
    return s && s.kind === "user" ? h("a", { href: "/jobs/" + encodeURIComponent(jobId) }, code) : code;
  }

  function hostOf(url) { try { return new URL(url).host; } catch (_) { return url; } }

  /** One row of the shared workers table (_workers_table.html): 11 columns. */
  function workerRow(w) {
    const gpu = w.gpu_count ? `${w.gpu_count} × ${w.gpu_model} (${fmt.num(w.vram_gb, 0)} GB)` : w.gpu_model;
    const trust = [h("span", { class: "badge s-" + w.trust, title: w.trust_reason || "" }, w.trust)];
    if (w.bad_chunks > 0) {
      trust.push(" ", h("span", { class: "badge s-failed", title: "Chunks this worker served failed sha256 verification" },
        `${w.bad_chunks} bad chunk${w.bad_chunks === 1 ? "" : "s"}`));
    }
    const relay = w.relay_url ? [h("span", { class: "badge s-relay" }, "relay"), " ", h("code", { title: w.relay_url }, hostOf(w.relay_url))]
      : h("span", { class: "muted" }, "leaf");
    return h("tr", { dataset: { key: w.id } },
      h("th", { scope: "row" }, h("a", { href: "/workers/" + encodeURIComponent(w.id) }, w.name)),
      h("td", {}, badge(w.status)),
      h("td", {}, gpu),
      h("td", { class: "num" }, fmt.usd(w.price_per_hour)),
      h("td", { class: "num" }, fmt.num(w.rollouts_per_s)),
      h("td", {}, jobRef(w.job_id)),
      h("td", { class: "num" }, w.version_held ?? "–"),
      h("td", { class: "num" }, `${w.accepted_rollouts} · ${w.rejected_rollouts}`),
      h("td", {}, trust),
      h("td", { class: "relay" }, relay),
      h("td", {}, timeEl(w.last_heartbeat_at, true)));
  }

  // ---- chrome: nav, logout, guard -----------------------------------------------------------
  function roleTags(s) {
    if (!s) return [];
    if (s.kind === "provider") return ["provider"];
    return s.role === "admin" ? ["user", "admin"] : ["user"];
  }

  /** Nav for the session's role; false (and a redirect) when nobody is logged in. */
  function chrome() {
    const s = session.get();
    if (!s) { toLogin(); return false; }
    const tags = roleTags(s);
    for (const li of $$("#nav li")) {
      li.hidden = !li.dataset.for.split(" ").some((t) => tags.includes(t));
      const a = $("a", li);
      if (a.getAttribute("href") === location.pathname) a.setAttribute("aria-current", "page");
    }
    $("#nav").hidden = false;
    $("#who").hidden = false;
    setText("#who-name", `${s.name} (${s.kind === "provider" ? "provider" : s.role})`);
    $("#logout").addEventListener("click", () => { session.clear(); location.assign("/login"); });
    if (s.kind === "provider") $(".brand").setAttribute("href", "/provider");
    return true;
  }

  /** A page the API refuses (404, 403, ...) says why instead of staying blank or stale; null clears it. */
  function pageError(err) {
    const el = document.getElementById("page-error");
    if (!el) return;
    el.hidden = !err;
    if (!err) return;
    const text = err.status === 404 ? "Not found: it does not exist or is not yours."
      : err.status === 403 ? "Your token cannot see this page: " + err.message : err.message;
    if (el.textContent !== text) el.textContent = text;
  }

  function failPage(err) {
    if (err instanceof ApiError) pageError(err); else report(err);
  }

  const pages = {};
  /** Register a page's start function; it runs after the chrome, only for a logged-in session. */
  function page(name, start) { pages[name] = start; }

  // ---- login page ---------------------------------------------------------------------------
  function loginPage() {
    const form = $("#login-form");
    const input = $("#api-key");
    const error = $("#api-key-error");
    input.focus();
    form.addEventListener("submit", async (ev) => {
      ev.preventDefault();
      const key = input.value.trim();
      error.hidden = true;
      input.removeAttribute("aria-invalid");
      if (!key) return fail("Paste your API key or provider token.");
      try {
        let s;
        if (key.startsWith("e2p_")) {
          const p = await api("/v1/providers/me", { key });
          s = { key, kind: "provider", id: p.id, name: p.name, role: "provider" };
        } else {
          const u = await api("/v1/me", { key });
          s = { key, kind: "user", id: u.id, name: u.name, role: u.role };
        }
        session.set(s);
        location.assign(sameSite(new URLSearchParams(location.search).get("next"))
          || (s.kind === "provider" ? "/provider" : "/jobs"));
      } catch (err) {
        fail(err.status === 401 ? "This key is unknown or revoked."
          : err.status === 403 ? "This token cannot use the dashboard (use a user API key or a provider token)."
            : err.message);
      }
    });
    /** `next` as a path of this site, or null: "/\\host" and "/<TAB>/host" look like paths but browsers read
     * them as "//host", so the URL is resolved as the browser would and its origin compared. */
    function sameSite(next) {
      if (!next) return null;
      const url = new URL(next, location.origin);
      return url.origin === location.origin && url.pathname !== "/login" ? url.pathname + url.search + url.hash : null;
    }
    function fail(text) {
      error.textContent = text;
      error.hidden = false;
      input.setAttribute("aria-invalid", "true");
      input.focus();
    }
  }

  function idempotencyKey() {
    const bytes = crypto.getRandomValues(new Uint8Array(16));
    return "web-" + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
  }

  window.E2 = {
    session, api, query, poll, h, $, $$, setText, fillRows, announce, confirmAction, showErrors, clearErrors,
    fmt, timeEl, badge, TERMINAL, workerRow, jobRef, pageError, ApiError, idempotencyKey, page, report,
  };

  document.addEventListener("DOMContentLoaded", () => {
    const name = document.body.dataset.page;
    if (name === "login") { loginPage(); return; }
    if (!chrome()) return;
    const start = pages[name];
    if (start) Promise.resolve().then(() => start(session.get())).catch(failPage);
  });
})();
