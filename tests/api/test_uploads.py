"""Datasets of any size in resumable parts, chat items, and every bad line named with its number."""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

from api.models import DatasetUpload, utcnow
from api.services import uploads
from tests.factories import job_spec, new_user, ok


def _start(client, name: str, data: bytes):  # type: ignore[no-untyped-def]
    body = {"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    return ok(client.post("/v1/datasets/uploads", json=body))


def _put(client, upload, index: int, data: bytes):  # type: ignore[no-untyped-def]
    return client.put(f"/v1/datasets/uploads/{upload['id']}/parts/{index}", content=data,
                      headers={"Content-Type": "application/octet-stream",
                               "X-Echo2-Sha256": hashlib.sha256(data).hexdigest()})


def test_an_upload_in_parts_resumes_with_the_parts_missing_and_completes(api):
    _, alice = new_user(api)
    line = json.dumps({"question": "2+2? " + "x" * 3000, "answer": "4"}) + "\n"
    data = (line * (2 * 8 * 2**20 // len(line) + 5)).encode()  # three parts of 8 MiB
    upload = _start(alice, "big", data)
    size = upload["part_size"]
    assert upload["parts"] == 3 and upload["received"] == []
    parts = [data[i * size:(i + 1) * size] for i in range(3)]
    assert _put(alice, upload, 0, parts[0]).status_code == 204
    assert _put(alice, upload, 2, parts[2]).status_code == 204
    early = alice.post(f"/v1/datasets/uploads/{upload['id']}/complete")
    assert early.status_code == 409 and "1 parts are missing (first: [1])" in early.json()["detail"]
    resumed = _start(alice, "big", data)  # the same file again: the upload begun
    assert resumed["id"] == upload["id"] and resumed["received"] == [0, 2]
    wrong = alice.put(f"/v1/datasets/uploads/{upload['id']}/parts/1", content=parts[1],
                      headers={"Content-Type": "application/octet-stream", "X-Echo2-Sha256": "0" * 64})
    assert wrong.status_code == 422 and "does not match its sha256" in wrong.json()["detail"]
    short = _put(alice, upload, 1, parts[1][:-1])
    assert short.status_code == 422 and f"must have {size} bytes" in short.json()["detail"]
    assert _put(alice, upload, 3, b"x").status_code == 422
    _, mallory = new_user(api, "mallory")
    assert _put(mallory, upload, 1, parts[1]).status_code == 404
    assert _put(alice, upload, 1, parts[1]).status_code == 204
    dataset = ok(alice.post(f"/v1/datasets/uploads/{upload['id']}/complete"), 201)
    assert dataset["num_items"] == data.count(b"\n") and dataset["keys"] == ["answer", "question"]
    assert alice.get(f"/v1/datasets/uploads/{upload['id']}").status_code == 404  # done: gone
    assert not (api.server.settings.data_dir / "uploads" / upload["id"]).exists()
    again = alice.post("/v1/datasets/uploads", json={"name": "big", "size": len(data),  # run again "to resume"
                                                     "sha256": hashlib.sha256(data).hexdigest()})
    assert again.status_code == 409 and f"this file is dataset {dataset['id']} already" in again.json()["detail"]
    assert _start(alice, "big copy", data)["received"] == []  # under another name: a new upload
    assert ok(alice.get("/v1/datasets"))["total"] == 1


def test_a_completion_whose_commit_fails_keeps_the_uploads_parts_to_complete_again(api, monkeypatch):
    """The parts were deleted before the dataset's transaction committed: a commit that failed (or a process killed
    before it) rolled back to the upload's row with no parts on disk (received [], completing again a 409), and
    the whole file had to be sent again. The parts now go only once the commit succeeded, as `abandon`'s do."""
    _, alice = new_user(api)
    data = b"".join(json.dumps({"question": f"{i}+1?", "answer": str(i + 1)}).encode() + b"\n" for i in range(50))
    upload = _start(alice, "sums", data)
    assert _put(alice, upload, 0, data).status_code == 204
    store = uploads.store

    def refuse() -> None:
        raise RuntimeError("the database refused the commit")

    def store_then_fail_the_commit(db, *args, **kwargs):  # type: ignore[no-untyped-def]
        db.commit = refuse  # the route's session only: every other request commits as usual
        return store(db, *args, **kwargs)

    monkeypatch.setattr(uploads, "store", store_then_fail_the_commit)
    assert alice.post(f"/v1/datasets/uploads/{upload['id']}/complete").status_code == 500
    monkeypatch.setattr(uploads, "store", store)

    with api.client(alice.headers["Authorization"].removeprefix("Bearer ")) as again:  # a 500 drops the connection
        assert ok(again.get("/v1/datasets"))["total"] == 0
        assert ok(again.get(f"/v1/datasets/uploads/{upload['id']}"))["received"] == [0]
        assert ok(again.post(f"/v1/datasets/uploads/{upload['id']}/complete"), 201)["num_items"] == 50
    assert not (api.server.settings.data_dir / "uploads" / upload["id"]).exists()


def test_every_bad_line_is_named_with_its_number(api):
    _, alice = new_user(api)
    lines = [{"prompt": "ok", "reference": "1"}, "{oops", {"prompt": "ok"}, {"prompt": ["a"]},
             {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
             {"messages": [{"role": "wizard", "content": "hi"}]}, {"prompt": "ok", "reference": "2"}]
    data = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines).encode() + b"\n"
    upload = _start(alice, "bad", data)
    assert _put(alice, upload, 0, data).status_code == 204
    refused = alice.post(f"/v1/datasets/uploads/{upload['id']}/complete")
    assert refused.status_code == 422
    body = refused.json()
    assert body["detail"].startswith("4 bad lines of 7: line 2: not valid JSON")
    reasons = [e["reason"] for e in body["errors"]]
    assert [r.split(":")[0] for r in reasons] == ["line 2", "line 4", "line 5", "line 6"]
    assert "key 'prompt' holds a list; only 'messages' may" in reasons[1]
    assert "'messages' must end with a user turn" in reasons[2]
    assert reasons[3] == "line 6: key 'messages': 0.role: Input should be 'system', 'user' or 'assistant'"
    one_shot = alice.post("/v1/datasets/upload", data={"name": "bad"}, files={"file": ("d.jsonl", data)})
    assert one_shot.status_code == 422 and [e["reason"] for e in one_shot.json()["errors"]] == reasons
    assert ok(alice.get("/v1/datasets"))["total"] == 0


def test_chat_items_give_their_last_user_turn_to_the_task_and_keep_the_turns_before(api):
    _, alice = new_user(api)
    items = [{"messages": [{"role": "system", "content": "Answer with a number."},
                           {"role": "user", "content": f"{i}+1?"}], "answer": str(i + 1)} for i in range(20)]
    items.append({"question": "plain: 1+1?", "answer": "2"})
    dataset = ok(alice.post("/v1/datasets", json={"name": "chat", "items": items}), 201)
    assert dataset["keys"] == ["answer", "messages", "question"]
    job = ok(alice.post("/v1/jobs", json=job_spec(task={"name": "gsm8k", "params": {"template": "{question}"}},
                                                   num_prompts=None, dataset_id=dataset["id"],
                                                   eval={"fraction": 0.1, "size": 2})), 201)
    prompts = ok(alice.get(f"/v1/jobs/{job['id']}/prompts", params={"limit": 50}))["items"]
    chat = [p for p in prompts if p["context"] is not None]
    assert chat and all(p["context"] == [{"role": "system", "content": "Answer with a number."}] for p in chat)
    assert all(p["text"].endswith("+1?") for p in chat)
    assert [p["text"] for p in prompts if p["context"] is None] in ([], ["plain: 1+1?"])
    multi = alice.post("/v1/jobs", json=job_spec(task={"name": "guess_number"}, num_prompts=None,
                                                  prompts=[{"item": items[0]}]))
    assert multi.status_code == 422


def test_a_refused_file_is_dropped_with_its_parts_and_the_fixed_file_uploads_under_the_same_name(api):
    _, alice = new_user(api)
    uploads = api.server.settings.data_dir / "uploads"
    bad = b'{"prompt": "ok"}\n{oops\n["a list"]\n'
    upload = _start(alice, "mybad", bad)
    assert _put(alice, upload, 0, bad).status_code == 204 and (uploads / upload["id"] / "0.part").exists()
    refused = alice.post(f"/v1/datasets/uploads/{upload['id']}/complete")
    assert refused.status_code == 422 and refused.json()["detail"].startswith("2 bad lines of 3: line 2: not valid")
    assert not (uploads / upload["id"]).exists()  # its sha256 allows no fix in place: nothing to keep
    with api.db.session() as s:
        assert s.get(DatasetUpload, upload["id"]) is None
    again = _start(alice, "mybad", bad)  # the same bad file again: a new upload, not the refused one resumed
    assert again["id"] != upload["id"] and again["received"] == []
    assert alice.delete(f"/v1/datasets/uploads/{again['id']}").status_code == 204
    good = b'{"prompt": "ok"}\n{"prompt": "fixed"}\n'
    fixed = _start(alice, "mybad", good)
    assert _put(alice, fixed, 0, good).status_code == 204
    assert ok(alice.post(f"/v1/datasets/uploads/{fixed['id']}/complete"), 201)["num_items"] == 2
    assert not any((uploads / u["id"]).exists() for u in (upload, again, fixed))


def test_a_file_that_does_not_match_its_sha256_is_dropped_too(api):
    _, alice = new_user(api)
    data = b'{"prompt": "ok"}\n'
    body = {"name": "d", "size": len(data), "sha256": hashlib.sha256(b"x" * len(data)).hexdigest()}
    upload = ok(alice.post("/v1/datasets/uploads", json=body))
    assert _put(alice, upload, 0, data).status_code == 204  # the part matches its own sha256, not the file's
    refused = alice.post(f"/v1/datasets/uploads/{upload['id']}/complete")
    assert refused.status_code == 422 and "does not match the sha256" in refused.json()["detail"]
    assert alice.get(f"/v1/datasets/uploads/{upload['id']}").status_code == 404
    assert not (api.server.settings.data_dir / "uploads" / upload["id"]).exists()


def test_the_retention_sweep_drops_an_upload_that_received_nothing_for_a_while(api):
    """An interrupted upload resumes for ECHO2_ARCHIVE_AFTER_H after its last part; then nothing would ever remove
    its parts, so the sweep drops it. One that is still receiving parts is kept."""
    import asyncio
    import os
    import time

    from api.services import retention

    _, alice = new_user(api)
    uploads = api.server.settings.data_dir / "uploads"
    files = {name: b'{"prompt": "%s"}\n' % name.encode() for name in ("idle", "busy")}
    idle, busy = (_start(alice, name, data) for name, data in files.items())
    for upload, data in zip((idle, busy), files.values(), strict=True):  # never completed: as if interrupted
        assert _put(alice, upload, 0, data).status_code == 204
    two_hours_ago = time.time() - 7200
    os.utime(uploads / idle["id"] / "0.part", (two_hours_ago, two_hours_ago))
    with api.db.session() as s:  # both started two hours ago; only the busy one got a part since
        for upload in (idle, busy):
            s.get_one(DatasetUpload, upload["id"]).created_at = utcnow() - timedelta(hours=2)
        s.commit()
    state = api.server.app.state
    settings = api.server.settings.model_copy(update={"archive_after_h": 1.0, "retention_sweep_s": 0})
    asyncio.run(retention.sweep_periodically(api.db, state.blobs, state.checkpoints, settings))
    assert alice.get(f"/v1/datasets/uploads/{idle['id']}").status_code == 404 and not (uploads / idle["id"]).exists()
    assert ok(alice.get(f"/v1/datasets/uploads/{busy['id']}"))["received"] == [0]


def test_a_part_sent_twice_at_once_is_stored_once_not_a_500(api):
    """A retry racing its first attempt (or two clients resuming one upload): each copy wrote the same `0.tmp`,
    and the slower found it moved away (a 500). Each copy now writes its own."""
    _, alice = new_user(api)
    key = alice.headers["Authorization"].removeprefix("Bearer ")
    line = json.dumps({"question": "2+2? " + "x" * 3000, "answer": "4"}) + "\n"
    data = (line * (8 * 2**20 // len(line) + 5)).encode()  # two parts
    upload = _start(alice, "raced", data)
    part = data[:upload["part_size"]]

    def put(_: int) -> int:
        with api.client(key) as client:
            return _put(client, upload, 0, part).status_code

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(put, range(8))) == [204] * 8
    assert _put(alice, upload, 1, data[upload["part_size"]:]).status_code == 204
    assert ok(alice.post(f"/v1/datasets/uploads/{upload['id']}/complete"), 201)["num_items"] == data.count(b"\n")


def test_one_user_may_not_declare_more_upload_bytes_than_the_platform_allows_at_once(api, monkeypatch):
    """An upload may declare up to 1 TiB and its parts fill the control plane's disk, which every tenant shares:
    one user could start any number of them."""
    monkeypatch.setattr(api.server.settings, "max_upload_bytes", 3 * 2**20)
    _, alice = new_user(api)
    first = _start(alice, "a", b"x" * 2**20)
    second = _start(alice, "b", b"y" * 2**20)
    over = alice.post("/v1/datasets/uploads", json={"name": "c", "size": 2 * 2**20, "sha256": "0" * 64})
    assert over.status_code == 413
    assert over.json()["detail"] == (
        "your uploads in progress declare 2.10 MB and this one 2.10 MB, more than the 3.15 MB one user may upload at "
        "once (ECHO2_MAX_UPLOAD_BYTES): complete or abandon one first (DELETE /v1/datasets/uploads/UPLOAD_ID)")
    assert _start(alice, "a", b"x" * 2**20)["id"] == first["id"]  # resuming one begun is never refused
    _, bob = new_user(api, "bob")
    assert _start(bob, "c", b"z" * 2 * 2**20)["received"] == []  # the bound is each user's
    assert alice.delete(f"/v1/datasets/uploads/{second['id']}").status_code == 204
    assert _start(alice, "c", b"z" * 2 * 2**20)["received"] == []
