"""A revoked key stops working once the revocation is answered. `auth.revoke` / `auth.revoke_all` cleared the identity
cache *before* the route committed, so a request with the key that read the token row in between (not revoked yet in
the database) put the key back in the cache, valid for `_IdentityCache.TTL_S` after the 204. Each test wraps the real
revocation to send that request in the window (PostgreSQL: SQLite's one connection serialises the two)."""

from __future__ import annotations

import httpx
import pytest

from api import auth
from tests.factories import new_user, ok


def test_a_key_used_while_its_revocation_commits_is_refused_after_the_revocation(api, monkeypatch):
    if not api.db.is_postgres:
        pytest.skip("SQLite's one connection serialises the two requests: the window exists on PostgreSQL")
    uid, alice = new_user(api, "alice")
    body = ok(alice.post(f"/v1/users/{uid}/keys"), 201)
    key, token_id = body["api_key"], body["token"]["id"]
    revoke = auth.revoke

    def revoke_while_the_key_is_in_use(db, token):  # type: ignore[no-untyped-def]
        revoke(db, token)
        # Another request with the key arrives now (between the cache's clear and the route's commit), as one of a
        # client's requests in flight does. Any request thread of the server serves it.
        r = httpx.get(f"{api.url}/v1/me", headers={"Authorization": f"Bearer {key}"}, timeout=10)
        assert r.status_code == 200  # the revocation is not committed yet: that is fair

    monkeypatch.setattr(auth, "revoke", revoke_while_the_key_is_in_use)
    assert api.admin.delete(f"/v1/tokens/{token_id}").status_code == 204
    monkeypatch.undo()

    r = api.client(key).get("/v1/me")

    assert r.status_code == 401, f"the revoked key still works after its revocation was answered: {r.status_code}"


def test_a_replaced_learners_token_is_fenced_even_if_it_was_used_while_the_new_one_was_issued(api, monkeypatch,
                                                                                             tmp_path):
    """`learning.issue_learner_token`: "earlier ones are revoked, so a learner presumed dead (but maybe only
    partitioned) can no longer report steps once its replacement is launched". The old learner beats while its
    replacement's token is issued (the same window as above): it goes on for TTL_S after the new token exists."""
    if not api.db.is_postgres:
        pytest.skip("SQLite's one connection serialises the two requests: the window exists on PostgreSQL")
    from tests.factories import fake_model_folder, running_job

    _, alice = new_user(api, "alice")
    job, old = running_job(api, alice, fake_model_folder(tmp_path / "m"))
    revoke_all = auth.revoke_all

    def revoke_while_the_old_learner_beats(db, kind, principal_id):  # type: ignore[no-untyped-def]
        revoke_all(db, kind, principal_id)
        r = httpx.post(f"{api.url}/v1/jobs/{job['id']}/learner/heartbeat", json={"step": 0},
                       headers={"Authorization": old.headers["Authorization"]}, timeout=10)
        assert r.status_code == 200

    monkeypatch.setattr(auth, "revoke_all", revoke_while_the_old_learner_beats)
    ok(api.admin.post(f"/v1/jobs/{job['id']}/learner/token"), 201)  # the replacement's token
    monkeypatch.undo()

    r = old.post(f"/v1/jobs/{job['id']}/learner/heartbeat", json={"step": 0})

    assert r.status_code == 401, f"the fenced learner's token still works: {r.status_code} {r.text}"
