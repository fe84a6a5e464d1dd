/* Admin: users (create), providers (sign up), tokens (list, revoke). Secrets are shown once. */
"use strict";

E2.page("admin", async (session) => {
  const { api, query, poll, h, $, fmt, timeEl, fillRows, setText } = E2;
  if (session.role !== "admin") {
    E2.pageError(new E2.ApiError(403, { detail: "Only admins can use this page." }));
    // The forms would only answer 403: not shown to those who cannot use them.
    for (const section of document.querySelectorAll("main section")) section.hidden = true;
    return;
  }
  const names = new Map();

  async function load() {
    const [users, providers, tokens] = await Promise.all([
      api("/v1/users"), api("/v1/providers"),
      api("/v1/tokens" + query({ kind: $("#t-kind").value, include_revoked: $("#t-revoked").checked || "", limit: 1000 })),
    ]);
    for (const u of users) names.set(u.id, u.name);
    for (const p of providers) names.set(p.id, p.name);
    fillRows($("#users-table tbody"), users.map((u) => h("tr", { dataset: { key: u.id } },
      h("th", { scope: "row" }, u.name), h("td", {}, u.role), h("td", {}, h("code", {}, u.id)),
      h("td", {}, timeEl(u.created_at)))), "No users.", 4);
    fillRows($("#providers-table tbody"), providers.map((p) => h("tr", { dataset: { key: p.id } },
      h("th", { scope: "row" }, p.name), h("td", {}, p.contact || "–"), h("td", { class: "num" }, String(p.num_workers)),
      h("td", { class: "num" }, fmt.usd(p.earnings_usd)), h("td", {}, timeEl(p.created_at)))), "No providers.", 5);
    fillRows($("#tokens-table tbody"), tokens.map(tokenRow), "No tokens.", 6);
  }

  function tokenRow(t) {
    const holder = names.get(t.principal_id);
    const revoke = t.revoked_at ? null : h("button", {
      type: "button", class: "danger small", "aria-label": `Revoke ${t.kind} token ${t.prefix}`,
      onclick: () => revokeToken(t, holder),
    }, "Revoke");
    return h("tr", { dataset: { key: t.id } },
      h("th", { scope: "row" }, h("code", {}, t.prefix + "…")),
      h("td", {}, t.kind),
      h("td", {}, holder || h("code", {}, t.principal_id)),
      h("td", {}, timeEl(t.created_at)),
      h("td", {}, t.revoked_at ? timeEl(t.revoked_at) : "–"),
      h("td", {}, revoke));
  }

  async function revokeToken(t, holder) {
    const mine = t.kind === "user" && t.principal_id === session.id;
    const ok = await E2.confirmAction("Revoke this token?",
      `The ${t.kind} token ${t.prefix}… of ${holder || t.principal_id} stops working immediately.` +
      (mine ? " It belongs to you: if it is the key you are using, you will be logged out." : ""), "Revoke");
    if (!ok) return;
    try {
      await api("/v1/tokens/" + encodeURIComponent(t.id), { method: "DELETE" });
      E2.announce(`Token ${t.prefix} revoked.`);
      setText("#token-status", "");
    } catch (err) {
      setText("#token-status", "Not revoked: " + err.message);
    }
    poller.now();
  }

  function showSecret(what, value) {
    setText("#secret-what", what);
    $("#secret-value").value = value;
    $("#secret").hidden = false;
    $("#secret-value").focus();
    $("#secret-value").select();
  }

  $("#user-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const form = ev.currentTarget;
    E2.clearErrors(form);
    try {
      const made = await api("/v1/users", { method: "POST", body: { name: $("#u-name").value, role: $("#u-role").value } });
      form.reset();
      showSecret(`User ${made.user.name} created. Their API key:`, made.api_key);
      poller.now();
    } catch (err) {
      E2.showErrors(form, err);
    }
  });

  $("#provider-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const form = ev.currentTarget;
    E2.clearErrors(form);
    const contact = $("#p-contact").value.trim();
    try {
      const made = await api("/v1/providers", { method: "POST", body: { name: $("#p-name").value, contact: contact || null } });
      form.reset();
      showSecret(`Provider ${made.provider.name} signed up. Their provider token:`, made.token);
      poller.now();
    } catch (err) {
      E2.showErrors(form, err);
    }
  });

  $("#t-kind").addEventListener("change", () => poller.now());
  $("#t-revoked").addEventListener("change", () => poller.now());
  $("#token-filters").addEventListener("submit", (ev) => ev.preventDefault());
  const poller = poll(load, 5000);
});
