from tests.factories import new_user, ok


def test_admin_creates_user_who_sees_themself(api):
    user_id, alice = new_user(api)
    me = ok(alice.get("/v1/me"))
    assert me["id"] == user_id and me["role"] == "user"
    assert user_id in {u["id"] for u in ok(api.admin.get("/v1/users"))}


def test_user_cannot_create_users_or_list_tokens(api):
    _, alice = new_user(api)
    assert alice.post("/v1/users", json={"name": "bob"}).status_code == 403
    assert alice.get("/v1/tokens").status_code == 403
    assert alice.get("/v1/users").status_code == 403


def test_missing_and_bad_tokens_are_401_problem_json(api):
    r = api.client().get("/v1/me")
    assert r.status_code == 401
    assert r.headers["content-type"].startswith("application/problem+json")
    assert r.headers["www-authenticate"] == "Bearer"
    assert "Authorization" in r.json()["detail"]
    assert api.client("e2u_nope").get("/v1/me").status_code == 401


def test_extra_api_key_and_revocation(api):
    user_id, alice = new_user(api)
    created = ok(alice.post(f"/v1/users/{user_id}/keys"), 201)
    second = api.client(created["api_key"])
    assert ok(second.get("/v1/me"))["id"] == user_id
    tokens = ok(api.admin.get("/v1/tokens", params={"kind": "user"}))
    assert created["token"]["id"] in {t["id"] for t in tokens}
    assert all("hash" not in t for t in tokens)
    assert api.admin.delete(f"/v1/tokens/{created['token']['id']}").status_code == 204
    assert second.get("/v1/me").status_code == 401
    assert ok(alice.get("/v1/me"))["id"] == user_id


def test_user_cannot_mint_keys_for_someone_else(api):
    bob_id, _ = new_user(api, "bob")
    _, alice = new_user(api)
    assert alice.post(f"/v1/users/{bob_id}/keys").status_code == 404


def test_admin_cannot_revoke_own_last_key(api):
    tokens = ok(api.admin.get("/v1/tokens", params={"kind": "user"}))
    assert len(tokens) == 1
    r = api.admin.delete(f"/v1/tokens/{tokens[0]['id']}")
    assert r.status_code == 409 and "last API key" in r.json()["detail"]


def test_validation_errors_name_the_field(api):
    r = api.admin.post("/v1/users", json={"name": "", "role": "emperor"})
    assert r.status_code == 422
    fields = {e["field"] for e in r.json()["errors"]}
    assert {"body.name", "body.role"} <= fields


def test_revoked_tokens_are_listed_only_on_request(api):
    user_id, alice = new_user(api)
    key = ok(alice.post(f"/v1/users/{user_id}/keys"), 201)["token"]["id"]
    assert api.admin.delete(f"/v1/tokens/{key}").status_code == 204
    assert key not in {t["id"] for t in ok(api.admin.get("/v1/tokens"))}
    revoked = {t["id"]: t for t in ok(api.admin.get("/v1/tokens", params={"include_revoked": True}))}
    assert revoked[key]["revoked_at"] is not None


def test_a_user_lists_and_revokes_its_own_api_keys_but_never_its_last(api):
    """A key a user minted for a CI runner leaked: it could not revoke it (DELETE /v1/tokens/{id} was admin-only,
    and it could not list its keys to name it), so a rotation left every old key working (review finding)."""
    alice_id, alice = new_user(api, "alice")
    minted = ok(alice.post(f"/v1/users/{alice_id}/keys"), 201)
    leaked = api.client(minted["api_key"])
    keys = ok(alice.get(f"/v1/users/{alice_id}/keys"))
    assert minted["token"]["id"] in {k["id"] for k in keys} and len(keys) == 2
    assert all("api_key" not in k for k in keys)

    assert alice.delete(f"/v1/tokens/{minted['token']['id']}").status_code == 204
    assert leaked.get("/v1/me").status_code == 401
    last = ok(alice.get(f"/v1/users/{alice_id}/keys"))[0]["id"]
    refused = alice.delete(f"/v1/tokens/{last}")
    assert refused.status_code == 409 and "last API key" in refused.json()["detail"]
    revoked = ok(alice.get(f"/v1/users/{alice_id}/keys", params={"include_revoked": True}))
    assert {k["id"]: k["revoked_at"] is not None for k in revoked} == {last: False, minted["token"]["id"]: True}


def test_another_user_can_neither_list_nor_revoke_alices_keys(api):
    alice_id, alice = new_user(api, "alice")
    _, bob = new_user(api, "bob")
    minted = ok(alice.post(f"/v1/users/{alice_id}/keys"), 201)
    assert bob.delete(f"/v1/tokens/{minted['token']['id']}").status_code == 404  # as an unknown id
    assert bob.get(f"/v1/users/{alice_id}/keys").status_code == 404
    assert ok(api.client(minted["api_key"]).get("/v1/me"))["id"] == alice_id
    assert api.admin.delete(f"/v1/tokens/{minted['token']['id']}").status_code == 204  # an admin may
