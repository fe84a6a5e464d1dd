"""Multi-turn episodes over the wire (api/services/episodes.py): the worker plays model turns, the
control plane runs the environment, keeps its secret and its reward, and checks the submitted group."""

import asyncio
import contextlib
import json
import shutil
import threading
import time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from echo2.protocol import EpisodeStep
from echo2_worker.control import ControlPlane
from sqlalchemy import func, select, update
from tokenizers import Tokenizer

from api.models import Episode, Job, Lease, LedgerEntry, Prompt, Rollout, Worker, utcnow
from api.services import archive, episodes, retention
from scheduler import billing
from scheduler.reconcile import _delivered
from tests.factories import activate, new_provider, new_user, new_worker, ok, publish, start_learner

GUESS = {"name": "guess_number", "params": {"low": 100_000, "high": 999_999, "max_turns": 3}}


@pytest.fixture
def game(api, tiny_model_dir):
    """A running guess-the-number job (six-digit secrets) at version 0 of the tiny model, one worker leasing."""
    _, alice = new_user(api)
    job = ok(alice.post("/v1/jobs", json={
        "name": "guess", "base_model": "echo2:tiny", "task": GUESS, "num_prompts": 8, "max_steps": 2,
        "grpo": {"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 16}, "staleness": 1}), 201)
    learner = start_learner(api, job["id"])
    publish(learner, job["id"], tiny_model_dir, version=0, step=0)
    _, provider = new_provider(api)
    wid, worker = new_worker(api, provider)
    activate(api, wid, job["id"])
    lease = ok(worker.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 2, "version": 0}), 201)
    return job, learner, worker, lease, Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))


def secret_of(api, prompt_id: int) -> str:
    with api.db.session() as s:
        prompt = s.get(Prompt, prompt_id)
        assert prompt is not None and prompt.reference is not None
        return prompt.reference


def turn(worker, lease, prompt_id, sample, k, ids):
    step = {"prompt_id": prompt_id, "sample": sample, "turn": k, "action_token_ids": ids}
    return worker.post(f"/v1/leases/{lease['id']}/episodes", json={"steps": [step]})


def reply(response):
    return ok(response)["replies"][0]


def said(tok, text: str) -> list[int]:
    """A model turn saying `text`, ended by the tiny model's eos (id 0) as a sampler stops."""
    return [*tok.encode(text).ids, 0]


def play(worker, lease, prompt_id, sample, guesses, tok):
    """Play guesses until done; returns (the sample as submitted, the raw response bodies)."""
    tokens, turns, bodies = [], [], []
    for k, guess in enumerate(guesses):
        action = said(tok, f"{guess}.")
        r = turn(worker, lease, prompt_id, sample, k, action)
        bodies.append(r.text)
        answer = reply(r)
        tokens += action
        turns.append(len(action))
        if answer["done"]:
            break
        tokens += answer["observation_token_ids"]
        turns.append(len(answer["observation_token_ids"]))
    return {"token_ids": tokens, "logprobs": [-1.0] * len(tokens), "finish_reason": "stop",
            "turns": turns}, bodies


def test_a_lease_of_a_multi_turn_job_says_how_to_play_it(game):
    _, _, _, lease, _ = game
    # Model turns, replies; an in-process environment answers as many steps as a request may carry.
    assert lease["episode"] == {"max_turns": 3, "max_tokens": 3 * 16 + 2 * 512, "max_steps": 4096}


def test_episodes_are_scored_by_the_platform_and_the_secret_never_reaches_the_worker(api, game):
    job, learner, worker, lease, tok = game
    first, second = (p["prompt_id"] for p in lease["prompts"])
    secret = secret_of(api, first)
    won, bodies = play(worker, lease, first, 0, [123_456, secret], tok)
    lost, more = play(worker, lease, first, 1, [111_111, 222_222, 333_333, 444_444], tok)
    assert won["turns"][1] > 0 and len(lost["turns"]) == 5  # three model turns, two replies in between
    hints = [reply(turn(worker, lease, first, 1, k, said(tok, g))) for k, g in
             enumerate(["111111.", "222222."])]  # retried turns: the same answers
    assert all(h["observation"] in ("higher.\n", "lower.\n") for h in hints)
    group = {"prompt_id": first, "version": 0, "prompt_token_ids": [1, 2], "samples": [won, lost]}
    result = ok(worker.post(f"/v1/leases/{lease['id']}/rollouts", json={"groups": [group]}))["results"][0]
    assert result["status"] == "accepted", result
    for body in [lease_text(worker, lease), *bodies, *more]:
        assert secret not in body and secret_of(api, second) not in body
    batch = ok(learner.post(f"/v1/jobs/{job['id']}/learner/claim", json={"step": 0, "max_groups": 4}))
    assert batch["groups"][0]["rewards"] == [1.0, 0.0]


def lease_text(worker, lease) -> str:
    return worker.post(f"/v1/leases/{lease['id']}/renew").text


def test_the_secrets_cannot_be_replayed_from_the_jobs_seed(api, game):
    """A worker can work a job's seed out of its leases' sample seeds (echo2.seeds): the hidden numbers must
    not be what generate_prompts draws from it."""
    from tasks import get_task

    job = game[0]
    task = get_task("guess_number")
    replayed = [p.reference for p in task.generate_prompts(task.parse_params(GUESS["params"]), job["spec"]["seed"], 8)]
    with api.db.session() as s:
        stored = [p.reference for p in s.query(Prompt).filter(Prompt.job_id == job["id"]).order_by(Prompt.id)]
    assert len(stored) == 8 and stored != replayed

def test_the_models_chat_template_frames_the_environments_reply(api, tiny_model_dir, tmp_path):
    templated = tmp_path / "templated"
    shutil.copytree(tiny_model_dir, templated)
    config = json.loads((templated / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}assistant: {% endif %}")
    (templated / "tokenizer_config.json").write_text(json.dumps(config))
    _, alice = new_user(api)
    job = ok(alice.post("/v1/jobs", json={
        "name": "guess", "base_model": "echo2:tiny", "task": GUESS, "num_prompts": 2, "max_steps": 1,
        "grpo": {"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 16}, "staleness": 1}), 201)
    publish(start_learner(api, job["id"]), job["id"], templated, version=0, step=0)
    _, provider = new_provider(api)
    wid, worker = new_worker(api, provider)
    activate(api, wid, job["id"])
    lease = ok(worker.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 1, "version": 0}), 201)
    tok = Tokenizer.from_file(str(templated / "tokenizer.json"))
    answer = reply(turn(worker, lease, lease["prompts"][0]["prompt_id"], 0, 0, said(tok, "hm")))
    # The model's turn ended with eos, which stands for the end of its turn; then the reply as a user turn.
    assert answer["observation"] == tok.decode(answer["observation_token_ids"]) == \
        "\nuser: say a number.\n\nassistant: "

def test_turns_must_come_in_order_and_a_replayed_turn_must_be_the_same(game):
    _, _, worker, lease, tok = game
    pid = lease["prompts"][0]["prompt_id"]
    assert turn(worker, lease, pid, 0, 1, said(tok, "5")).status_code == 409  # turn 0 never played
    reply(turn(worker, lease, pid, 0, 0, said(tok, "5")))
    clash = turn(worker, lease, pid, 0, 0, said(tok, "6"))
    assert clash.status_code == 409 and "other tokens" in clash.json()["detail"]


def test_bad_turns_are_refused_with_what_to_fix(api, game):
    _, _, worker, lease, tok = game
    pid = lease["prompts"][0]["prompt_id"]
    cases = {
        422: [turn(worker, lease, pid, 0, 0, [5] * 17),  # more than max_new_tokens
              turn(worker, lease, pid, 0, 0, [10**9]),  # outside the vocabulary
              turn(worker, lease, pid, 2, 0, [5])],  # sample outside the group
        404: [turn(worker, lease, 10**12, 0, 0, [5])],  # not in the lease
    }
    for status, responses in cases.items():
        for r in responses:
            assert r.status_code == status, r.text
            assert r.json()["detail"]
    _, provider = new_provider(api, "other-co")
    _, stranger = new_worker(api, provider, "stranger")
    assert turn(stranger, lease, pid, 0, 0, [5]).status_code == 404  # as an unknown lease


def test_a_group_that_is_not_its_episodes_is_refused_at_the_door(api, game):
    _, _, worker, lease, tok = game
    pid = lease["prompts"][0]["prompt_id"]
    secret = secret_of(api, pid)
    won, _ = play(worker, lease, pid, 0, [secret], tok)
    forged = {**won, "token_ids": [won["token_ids"][0] + 1, *won["token_ids"][1:]]}
    unplayed = {"token_ids": [5, 0], "logprobs": [-1.0, -1.0], "finish_reason": "stop", "turns": [2]}
    group = {"prompt_id": pid, "version": 0, "prompt_token_ids": [1, 2], "samples": [forged, unplayed]}
    result = ok(worker.post(f"/v1/leases/{lease['id']}/rollouts", json={"groups": [group]}))["results"][0]
    assert result["status"] == "rejected" and "differ from the turns played" in result["reason"]


def test_a_single_turn_job_has_no_episodes(api, tmp_path):
    from tests.factories import fake_model_folder, running_job

    _, alice = new_user(api)
    job, _ = running_job(api, alice, fake_model_folder(tmp_path / "m"))
    _, provider = new_provider(api)
    wid, worker = new_worker(api, provider)
    activate(api, wid, job["id"])
    lease = ok(worker.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 1, "version": 0}), 201)
    assert lease["episode"] is None
    r = turn(worker, lease, lease["prompts"][0]["prompt_id"], 0, 0, [5])
    assert r.status_code == 409 and "single-turn" in r.json()["detail"]


def test_a_bad_step_refuses_the_whole_request_and_stores_nothing(api, game):
    _, _, worker, lease, tok = game
    pid = lease["prompts"][0]["prompt_id"]
    good = {"prompt_id": pid, "sample": 0, "turn": 0, "action_token_ids": said(tok, "5")}
    bad = {**good, "sample": 1, "action_token_ids": [10**9]}
    r = worker.post(f"/v1/leases/{lease['id']}/episodes", json={"steps": [good, bad]})
    assert r.status_code == 422 and r.json()["detail"].startswith("steps.1:")
    twice = worker.post(f"/v1/leases/{lease['id']}/episodes", json={"steps": [good, good]})
    assert twice.status_code == 422 and "appears twice" in twice.json()["detail"]
    assert reply(turn(worker, lease, pid, 0, 0, said(tok, "5")))["turn"] == 0  # turn 0 was never stored


class Environment(BaseHTTPRequestHandler):
    """A user-hosted environment (tasks/http_env.py): guess the reference; `mode` makes it fail."""

    mode = "ok"
    seen: list[dict] = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Environment.seen.append(body)
        if Environment.mode == "slow":
            time.sleep(3)
        if Environment.mode == "lagging":
            time.sleep(0.8)  # within the job's 1 s timeout
        if Environment.mode == "down":
            return self._send(503, {"error": "down"})
        if Environment.mode == "strict" and not body["actions"][-1].strip().rstrip(".").isdigit():
            return self._send(400, {"error": "not a number"})  # as a real environment refuses what it cannot parse
        guess = body["actions"][-1].strip().rstrip(".")
        won = guess == body["reference"]
        self._send(200, {"done": True, "reward": 1.0} if won or len(body["actions"]) == 2
                   else {"done": False, "observation": "no.\n"})

    def _send(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError):  # the slow case: the control plane stopped waiting, as it should
            self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def hosted(api, tiny_model_dir):
    """A running http_env job whose environment is a real HTTP server on loopback."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), Environment)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Environment.mode, Environment.seen = "ok", []
    _, alice = new_user(api)
    task = {"name": "http_env", "params": {"url": f"http://127.0.0.1:{server.server_port}/step", "max_turns": 3,
                                           "timeout_s": 1.0, "max_retries": 1, "backoff_s": 0.0, "concurrency": 4}}
    job = ok(alice.post("/v1/jobs", json={
        "name": "hosted", "base_model": "echo2:tiny", "task": task, "max_steps": 2, "staleness": 1,
        "prompts": [{"item": {"prompt": "say 7.", "reference": "7"}} for _ in range(4)],
        "grpo": {"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 8}}), 201)
    learner = start_learner(api, job["id"])
    publish(learner, job["id"], tiny_model_dir, version=0, step=0)
    _, provider = new_provider(api)
    wid, worker = new_worker(api, provider)
    activate(api, wid, job["id"])
    lease = ok(worker.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 1, "version": 0}), 201)
    yield job, learner, worker, lease, Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")), wid
    server.shutdown()


def test_an_environment_hosted_by_the_user_plays_episodes_over_http(api, hosted):
    job, learner, worker, lease, tok, _ = hosted
    with api.db.session() as s:  # nothing held out: the learner's evaluation does not play episodes
        assert {p.state for p in s.query(Prompt).filter(Prompt.job_id == job["id"])} <= {"available", "leased"}
    pid = lease["prompts"][0]["prompt_id"]
    won, _ = play(worker, lease, pid, 0, ["7"], tok)
    lost, _ = play(worker, lease, pid, 1, ["3", "4"], tok)
    assert Environment.seen[-1] == {"prompt": "say 7.", "reference": "7", "actions": ["3.", "4."]}
    group = {"prompt_id": pid, "version": 0, "prompt_token_ids": [1, 2], "samples": [won, lost]}
    assert ok(worker.post(f"/v1/leases/{lease['id']}/rollouts", json={"groups": [group]}))["results"][0][
        "status"] == "accepted"
    batch = ok(learner.post(f"/v1/jobs/{job['id']}/learner/claim", json={"step": 0, "max_groups": 4}))
    assert batch["groups"][0]["rewards"] == [1.0, 1.0]  # the environment's own rewards


@pytest.mark.parametrize("mode", ["down", "slow"])
def test_a_failing_or_slow_environment_ends_its_episodes_with_a_clear_reason_not_the_workers_fault(
        api, hosted, mode):
    _, _, worker, lease, tok, wid = hosted
    Environment.mode = mode
    pid = lease["prompts"][0]["prompt_id"]
    steps = [{"prompt_id": pid, "sample": k, "turn": 0, "action_token_ids": said(tok, "7")} for k in range(2)]
    started = time.monotonic()
    replies = ok(worker.post(f"/v1/leases/{lease['id']}/episodes", json={"steps": steps}))["replies"]
    assert time.monotonic() - started < 10 and all(r["done"] for r in replies)
    sample = {"token_ids": said(tok, "7"), "logprobs": [-1.0] * len(said(tok, "7")), "finish_reason": "stop",
              "turns": [len(said(tok, "7"))]}
    group = {"prompt_id": pid, "version": 0, "prompt_token_ids": [1, 2], "samples": [sample, sample]}
    result = ok(worker.post(f"/v1/leases/{lease['id']}/rollouts", json={"groups": [group]}))["results"][0]
    assert result["status"] == "rejected" and "the environment failed at turn 0" in result["reason"]
    assert ("HTTP 503" if mode == "down" else "ReadTimeout") in result["reason"]
    standing = ok(worker.get(f"/v1/workers/{wid}"))
    assert standing["trust"] == "probation" and standing["trust_reason"] is None  # not struck: not its fault


def test_an_environment_at_work_holds_no_database_connection(api, hosted):
    """The route checks its steps, ends its transaction, then waits on the environment: on SQLite (one
    connection) another tenant's request used to wait for the environment too."""
    _, _, worker, lease, tok, _ = hosted
    Environment.mode = "lagging"
    pid = lease["prompts"][0]["prompt_id"]
    step = {"prompt_id": pid, "sample": 0, "turn": 0, "action_token_ids": said(tok, "3")}
    answers: list = []
    playing = threading.Thread(target=lambda: answers.append(worker.post(f"/v1/leases/{lease['id']}/episodes",
                                                                         json={"steps": [step]})))
    _, bob = new_user(api)
    playing.start()
    time.sleep(0.3)
    started = time.monotonic()
    ok(bob.get("/v1/jobs"))
    assert time.monotonic() - started < 0.4 and playing.is_alive()
    playing.join()
    assert reply(answers[0]) == {"turn": 0, "done": False, "observation": "no.\n",
                                 "observation_token_ids": tok.encode("no.\n").ids}


def test_a_request_carries_what_the_environment_answers_within_its_deadline(api, hosted):
    """A 1 s timeout and 4 at once: 60 s hold 240 steps. More would run past the deadline and fail episodes
    that an honest worker played; the worker is told to send them in several requests."""
    _, _, worker, lease, tok, _ = hosted
    assert lease["episode"]["max_steps"] == 240
    pid = lease["prompts"][0]["prompt_id"]
    steps = [{"prompt_id": pid, "sample": 0, "turn": 0, "action_token_ids": said(tok, "7")}] * 241
    r = worker.post(f"/v1/leases/{lease['id']}/episodes", json={"steps": steps})
    assert r.status_code == 422 and "at most 240" in r.json()["detail"] and Environment.seen == []


def test_a_turn_sent_twice_at_once_is_played_once(api, game, monkeypatch):
    """Racing twins of a first turn (a retry while its first attempt still runs) get one answer; a twin with
    other tokens is refused. On PostgreSQL both used to insert the episode, and the second got a 500. One
    process lets a worker play two requests at once, so six race here as they would across API processes."""
    monkeypatch.setattr(episodes, "PER_WORKER", 6)
    _, _, worker, lease, tok = game
    pid = lease["prompts"][0]["prompt_id"]
    same = race(worker, lease, pid, 0, [said(tok, "5")] * 6)
    assert [r.status_code for r in same] == [200] * 6 and len({r.text for r in same}) == 1
    other = race(worker, lease, pid, 1, [said(tok, str(k)) for k in range(6)])
    assert sorted(r.status_code for r in other) == [200] + [409] * 5


def race(worker, lease, pid, sample, actions):
    """Turn 0 of one episode, each action sent at once from a thread of its own."""
    answers: list = []
    twins = [threading.Thread(target=lambda ids=ids: answers.append(turn(worker, lease, pid, sample, 0, ids)))
             for ids in actions]
    for t in twins:
        t.start()
    for t in twins:
        t.join()
    return answers

def fail_all(worker, job, tok, lease=None) -> list[int]:
    """Lease every prompt the pool gives (or use `lease`), play each to the environment's failure, submit."""
    lease = lease or ok(worker.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 4, "version": 0}), 201)
    action = said(tok, "7")
    sample = {"token_ids": action, "logprobs": [-1.0] * len(action), "finish_reason": "stop", "turns": [len(action)]}
    pids = [p["prompt_id"] for p in lease["prompts"]]
    steps = [{"prompt_id": pid, "sample": k, "turn": 0, "action_token_ids": action} for pid in pids for k in range(2)]
    replies = ok(worker.post(f"/v1/leases/{lease['id']}/episodes", json={"steps": steps}))["replies"]
    assert all(r["done"] for r in replies)
    groups = [{"prompt_id": pid, "version": 0, "prompt_token_ids": [1, 2], "samples": [sample, sample]} for pid in pids]
    results = ok(worker.post(f"/v1/leases/{lease['id']}/rollouts", json={"groups": groups}))["results"]
    assert all("the environment failed at turn 0" in r["reason"] for r in results)
    return pids


def test_a_prompt_whose_environment_keeps_failing_is_set_aside_not_leased_forever(api, hosted):
    """Returned to the pool after each failure, such a prompt would be leased again and again (first, once
    starving) while the job's good prompts waited: after three failures it leaves the pool."""
    job, _, worker, lease, tok, _ = hosted
    Environment.mode = "down"
    first = fail_all(worker, job, tok, lease)[0]
    fail_all(worker, job, tok)
    fail_all(worker, job, tok)  # the third failure of `first`, the second of the others

    def state(model, key):
        with api.db.session() as s:
            row = s.get(model, key)
            return row.state if model is Prompt else (row.status, row.status_reason)

    assert state(Prompt, first) == "set_aside"
    assert state(Job, job["id"])[0] == "running"  # three prompts still cover a step
    rest = fail_all(worker, job, tok)
    assert first not in rest and len(rest) == 3
    status, reason = state(Job, job["id"])
    assert status == "failed"
    assert reason.startswith("only 0 prompts are left, a step takes 2: the environment failed 3 times"), reason


def test_one_provider_alone_cannot_set_a_jobs_prompts_aside(api, hosted):
    """Actions that break the environment are the worker's to choose: with two providers' workers on the job,
    three failures from one provider's, even from two of its workers, leave the prompt in the pool, and the
    other provider's failure sets it aside."""
    job, _, worker, lease, tok, _ = hosted  # `worker` holds a lease: the job has had two workers from here
    Environment.mode = "down"
    _, provider = new_provider(api)
    wid, other = new_worker(api, provider)
    activate(api, wid, job["id"])
    mine = [fail_all(other, job, tok) for _ in range(3)]
    assert all(set(m) == set(mine[0]) and len(m) == 3 for m in mine)
    twin_id, twin = new_worker(api, provider, "twin")  # a second worker of the same provider
    activate(api, twin_id, job["id"])
    assert set(fail_all(twin, job, tok)) == set(mine[0])
    with api.db.session() as s:
        assert {s.get(Prompt, pid).state for pid in mine[0]} == {"available"}
        assert _delivered(s, wid, utcnow() - timedelta(minutes=5))[0] == 0  # 9 groups, none of use to the job
    fail_all(worker, job, tok, lease)
    assert set(mine[0]) < set(fail_all(worker, job, tok))
    with api.db.session() as s:
        assert {s.get(Prompt, pid).state for pid in mine[0]} == {"set_aside"}
        assert s.get(Job, job["id"]).status == "failed"  # one prompt left, a step takes two


def test_the_retention_sweep_deletes_the_episodes_of_ended_leases(api, game):
    """Played episodes are read while their lease is active; once it ended (here: the job was cancelled) the
    sweep deletes them, the submitted and the abandoned alike, and the submitted group still reads the same."""
    job, _, worker, lease, tok = game
    first, second = (p["prompt_id"] for p in lease["prompts"])
    won, _ = play(worker, lease, first, 0, [secret_of(api, first)], tok)
    lost, _ = play(worker, lease, first, 1, [111_111, 222_222, 333_333], tok)
    play(worker, lease, second, 0, [111_111], tok)  # never finished nor submitted
    group = {"prompt_id": first, "version": 0, "prompt_token_ids": [1, 2], "samples": [won, lost]}
    rid = ok(worker.post(f"/v1/leases/{lease['id']}/rollouts", json={"groups": [group]}))["results"][0]["rollout_id"]
    settings = api.server.settings.model_copy(update={"archive_after_h": 0.0})

    def sweep() -> int:
        state = api.server.app.state
        asyncio.run(retention.sweep_periodically(api.db, state.blobs, state.checkpoints, settings))
        with api.db.session() as s:
            return s.scalar(select(func.count()).select_from(Episode).where(Episode.job_id == job["id"]))

    before = ok(api.admin.get(f"/v1/jobs/{job['id']}/rollouts/{rid}"))
    assert sweep() == 3  # the lease is active: its episodes may still be played and submitted
    ok(api.admin.post(f"/v1/jobs/{job['id']}/cancel"))
    assert sweep() == 0
    assert ok(api.admin.get(f"/v1/jobs/{job['id']}/rollouts/{rid}")) == before
    with api.db.session() as s:
        row = s.get(Rollout, rid)
        assert row is not None and row.archive is not None  # the job ended: its tokens are in its archive file
        kept = archive.payloads(settings.data_dir, [row])[rid].samples
    assert [(k["token_ids"], k["turns"]) for k in kept] == [(won["token_ids"], won["turns"]),
                                                            (lost["token_ids"], lost["turns"])]


def test_episode_requests_never_take_every_request_thread(api, hosted, monkeypatch):
    """Each playing request holds an API thread for as long as its environments take (up to 60 s): one worker
    may have two playing, a process sixteen (one here), and a request past that is told to retry at once,
    while other routes answer as ever."""
    _, _, worker, lease, tok, _ = hosted
    Environment.mode = "lagging"
    pid = lease["prompts"][0]["prompt_id"]

    def step(sample, k=0):
        return {"steps": [{"prompt_id": pid, "sample": sample, "turn": k, "action_token_ids": said(tok, "3")}]}

    def playing(sample, answers, k=0):
        thread = threading.Thread(target=lambda: answers.append(
            worker.post(f"/v1/leases/{lease['id']}/episodes", json=step(sample, k))))
        thread.start()
        return thread

    answers: list = []
    threads = [playing(0, answers), playing(1, answers)]
    time.sleep(0.3)
    third = worker.post(f"/v1/leases/{lease['id']}/episodes", json=step(0))
    assert third.status_code == 429 and third.headers["Retry-After"] == "1"
    assert "2 episode requests playing already" in third.json()["detail"]
    for thread in threads:
        thread.join()
    assert [r.status_code for r in answers] == [200, 200]

    monkeypatch.setattr(episodes, "IN_FLIGHT", 1)
    _, provider = new_provider(api)
    other_id, other = new_worker(api, provider)
    activate(api, other_id, hosted[0]["id"])
    theirs = ok(other.post("/v1/leases", json={"job_id": hosted[0]["id"], "max_prompts": 1, "version": 0}), 201)
    busy = [playing(1, answers, k=1)]  # a new turn: one the environment plays
    time.sleep(0.3)
    step_theirs = {"prompt_id": theirs["prompts"][0]["prompt_id"], "sample": 0, "turn": 0,
                   "action_token_ids": said(tok, "3")}
    refused = other.post(f"/v1/leases/{theirs['id']}/episodes", json={"steps": [step_theirs]})
    assert refused.status_code == 429 and "this API process is playing 1 episode requests" in refused.text
    started = time.monotonic()
    ok(other.get(f"/v1/workers/{other_id}"))  # a route that needs a request thread
    assert time.monotonic() - started < 0.4
    busy[0].join()
    assert reply(other.post(f"/v1/leases/{theirs['id']}/episodes", json={"steps": [step_theirs]}))["turn"] == 0


def test_a_worker_asks_again_while_the_process_is_busy_playing_others(api, hosted, monkeypatch):
    """The worker's client (echo2_worker.control) retries a 429 for as long as it would wait for an answer,
    not three times: a fleet's episodes may fill a process's slots for a minute."""
    _, _, worker, lease, tok, _ = hosted
    monkeypatch.setattr(episodes, "IN_FLIGHT", 1)
    release = threading.Event()

    def held_elsewhere():
        with episodes.playing_slot("another-worker"):
            release.wait(10)

    holder = threading.Thread(target=held_elsewhere)
    holder.start()
    threading.Timer(5.0, release.set).start()
    control = ControlPlane(api.server.url, worker.headers["Authorization"].removeprefix("Bearer "))
    step = EpisodeStep(prompt_id=lease["prompts"][0]["prompt_id"], sample=0, turn=0, action_token_ids=said(tok, "7"))
    started = time.monotonic()
    try:
        answer = control.play_turns(lease["id"], [step])
    finally:
        release.set()
        holder.join()
        control.close()
    assert time.monotonic() - started >= 4.5 and answer[0].done


def test_an_environment_failure_is_paid_only_once_another_provider_saw_it_too(api, hosted):
    """A group whose environment failed is never audited, and junk actions a worker sends without generating
    make a strict environment fail (400) as surely as an outage: alone, such failures earn nothing. Once a worker
    of another provider saw the environment fail on the same prompt, it is the environment's, and both are paid."""
    job, _, _, _, tok, _ = hosted
    Environment.mode = "strict"
    junk = said(tok, "zz")
    pays, pid = [], None
    for name in ("cheap-gpus", "other-gpus"):
        _, provider = new_provider(api, name)
        wid, worker = new_worker(api, provider, price_per_hour=3600.0)
        activate(api, wid, job["id"])
        lease = ok(worker.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 1, "version": 0}), 201)
        pid = pid or lease["prompts"][0]["prompt_id"]
        assert lease["prompts"][0]["prompt_id"] == pid  # the prompt went back to the pool, first in line
        steps = [{"prompt_id": pid, "sample": k, "turn": 0, "action_token_ids": junk} for k in range(2)]
        assert all(r["done"] for r in ok(worker.post(f"/v1/leases/{lease['id']}/episodes",
                                                     json={"steps": steps}))["replies"])
        sample = {"token_ids": junk, "logprobs": [-1.0] * len(junk), "finish_reason": "stop", "turns": [len(junk)]}
        group = {"prompt_id": pid, "version": 0, "prompt_token_ids": [1, 2], "samples": [sample, sample]}
        result = ok(worker.post(f"/v1/leases/{lease['id']}/rollouts", json={"groups": [group]}))["results"][0]
        assert result["status"] == "rejected" and "HTTP 400" in result["reason"]
        pays.append((wid, paid_to(api, wid)))
    (first, alone), (second, _) = pays
    assert alone == 0.0  # its failure alone: unpaid
    assert paid_to(api, first) > 0 and paid_to(api, second) > 0  # seen by two providers: the environment's


def paid_to(api, worker_id: str) -> float:
    """Bill a minute of the worker's active time (scheduler/billing.py) and return what it was paid in all."""
    now = utcnow()
    with api.db.session() as s:
        worker = s.get_one(Worker, worker_id)
        worker.status, worker.desired, worker.activated_mu = "active", "active", 1.0
        billing.bill(s, api.server.settings, now, last=now.timestamp() - 60)
        s.commit()
        return sum(e.amount_usd for e in s.scalars(select(LedgerEntry).where(LedgerEntry.worker_id == worker_id)))


def test_a_lease_whose_episodes_are_being_played_is_not_idle(api, game):
    """A worker that holds prompts without sending a group for ECHO2_LEASE_IDLE_S (and IDLE_PATIENCE times its own
    pace) loses its lease; a multi-turn lease sends its groups only once its episodes end, and an environment may
    take minutes a turn: its turns count as work."""
    job, _, worker, lease, tok = game
    pid = lease["prompts"][0]["prompt_id"]
    with api.db.session() as s:  # granted two hours ago, renewed since
        s.get_one(Lease, lease["id"]).created_at = utcnow() - timedelta(hours=2)
        s.commit()
    reply(turn(worker, lease, pid, 0, 0, said(tok, "500000")))  # a turn just now
    ok(worker.post(f"/v1/leases/{lease['id']}/renew"))
    with api.db.session() as s:  # ... and that turn, too, two hours ago
        s.execute(update(Episode).where(Episode.lease_id == lease["id"]).values(
            updated_at=utcnow() - timedelta(hours=2)))
        s.commit()
    refused = worker.post(f"/v1/leases/{lease['id']}/renew")
    assert refused.status_code == 409 and "held prompts for" in refused.text, refused.text


def test_a_model_turn_cut_short_of_its_stop_is_refused(api, game):
    """A sampler ends a model turn at a stop token, at max_new_tokens, or where the model's context ends: a worker
    that cut every turn after one token (1/16 of the decode, every token replaying exactly) was audited, passed and
    paid as honest work (review finding). Such a turn ends its episode, and its group is refused at the door (a
    strike) unless prompt and turns fill the context."""
    _, _, worker, lease, tok = game
    pid = lease["prompts"][0]["prompt_id"]
    cut = tok.encode("5").ids
    for k in range(2):
        assert reply(turn(worker, lease, pid, k, 0, cut))["done"]
    group = {"prompt_id": pid, "version": 0, "prompt_token_ids": [1, 2, 3],
             "samples": [{"token_ids": cut, "logprobs": [-1.0] * len(cut), "finish_reason": "length",
                          "turns": [len(cut)]}] * 2}
    [out] = ok(worker.post(f"/v1/leases/{lease['id']}/rollouts", json={"groups": [group]}))["results"]
    assert out["status"] == "rejected" and "its last turn ended after 1 tokens without a stop token" in out["reason"]
    other = lease["prompts"][1]["prompt_id"]
    assert not reply(turn(worker, lease, other, 0, 0, [5] * 16))["done"]  # max_new_tokens: a whole turn
    assert not reply(turn(worker, lease, other, 1, 0, said(tok, "123456.")))["done"]  # its stop token


def test_an_honest_turn_stopped_by_the_models_context_ends_its_episode(api, tiny_model_dir):
    """A turn that ends where the model's context does (vLLM, and the transformers backend, stop there) was refused
    as cut short (review finding): it ends its episode, and the group that fills the context exactly is taken."""
    _, alice = new_user(api)
    job = ok(alice.post("/v1/jobs", json={
        "name": "guess", "base_model": "echo2:tiny", "task": GUESS, "num_prompts": 8, "max_steps": 2,
        "grpo": {"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 400}, "staleness": 1}), 201)
    publish(start_learner(api, job["id"]), job["id"], tiny_model_dir, version=0, step=0)
    wid, worker = new_worker(api, new_provider(api)[1])
    activate(api, wid, job["id"])
    lease = ok(worker.post("/v1/leases", json={"job_id": job["id"], "max_prompts": 1, "version": 0}), 201)
    pid, prompt = lease["prompts"][0]["prompt_id"], [1] * 20
    samples = []
    for k in range(2):
        answer = reply(turn(worker, lease, pid, k, 0, [5] * 400))  # a whole turn: its limit
        observation = answer["observation_token_ids"]
        last = [6] * (512 - len(prompt) - 400 - len(observation))  # stopped where the context ends
        assert reply(turn(worker, lease, pid, k, 1, last))["done"]
        tokens = [5] * 400 + observation + last
        samples.append({"token_ids": tokens, "logprobs": [-1.0] * len(tokens), "finish_reason": "length",
                        "turns": [400, len(observation), len(last)]})
    group = {"prompt_id": pid, "version": 0, "prompt_token_ids": prompt, "samples": samples}
    [out] = ok(worker.post(f"/v1/leases/{lease['id']}/rollouts", json={"groups": [group]}))["results"]
    assert out["status"] == "accepted", out
