"""Task adapters: registry, params validation, prompt sources, verifiers, the HTTP verifier, episodes."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tasks import (
    ScoringError,
    TaskAdapter,
    TaskError,
    TaskItemError,
    TaskParams,
    TaskParamsError,
    TaskPrompt,
    UnknownTaskError,
    get_task,
    list_tasks,
    register,
    run_episode,
)
from tasks.answers import extract_final_answer, numbers_equal, parse_number
from tasks.arithmetic import DEMO_DEFAULTS

BUILTIN = {"arithmetic", "gsm8k", "exact_match", "regex", "http_reward", "http_env", "guess_number"}


def test_tasks_import_without_torch():
    code = "import sys, tasks as t; t.list_tasks(); assert 'torch' not in sys.modules, 'torch'"
    code += "; assert 'transformers' not in sys.modules, 'transformers'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_registry_lists_and_rejects_unknown_names():
    assert set(list_tasks()) >= BUILTIN
    with pytest.raises(UnknownTaskError) as exc:
        get_task("gsm9k")
    assert "unknown task 'gsm9k'" in str(exc.value) and "arithmetic" in str(exc.value)


def test_a_new_task_is_one_class_and_one_register_call():
    class Echo(TaskAdapter):
        name = "test_echo"

        def reward(self, prompt, completion, params):
            return float(completion == prompt.text)

    register(Echo())
    register(Echo())  # idempotent for the same class
    task = get_task("test_echo")
    assert task.reward(TaskPrompt(text="hi"), "hi", task.parse_params({})) == 1.0
    assert not task.multi_turn

    class Other(Echo):
        pass

    with pytest.raises(TaskError, match="already registered"):
        register(Other())


def test_params_errors_name_each_field():
    task = get_task("arithmetic")
    with pytest.raises(TaskParamsError) as exc:
        task.parse_params({"max_operand": 5000, "ops": ["/"], "colour": "red"})
    fields = {loc for loc, _ in exc.value.errors}
    assert {"max_operand", "ops.0", "colour"} <= fields
    assert "invalid params for task 'arithmetic'" in str(exc.value)
    with pytest.raises(TaskParamsError, match="max_operand must be >= min_operand"):
        task.parse_params({"min_operand": 5, "max_operand": 2})


def test_arithmetic_holds_out_problems_it_never_generates_for_training():
    task = get_task("arithmetic")
    two_digit = task.parse_params({"min_operand": 10, "max_operand": 99, "style": "question"})
    held = task.eval_prompts(two_digit, seed=0, count=64)
    trained = task.generate_prompts(two_digit, seed=0, count=5000)
    assert len({p.text for p in held}) == 64 and not {p.text for p in held} & {p.text for p in trained}
    assert {p.text for p in held} <= {p.text for p in task.all_prompts(two_digit, held=True)}
    assert len(task.all_prompts(two_digit, held=True)) == pytest.approx(0.2 * 8100, rel=0.05)
    assert task.eval_prompts(two_digit, seed=1, count=64) != held  # another job draws another sample...
    again = task.eval_prompts(two_digit, seed=1, count=5000)  # ...of the same held-out problems
    assert {p.text for p in again} == {p.text for p in task.all_prompts(two_digit, held=True)}
    huge = task.parse_params({"max_operand": 1000, "ops": ["+", "*"]})  # sampled, not enumerated
    big_held = task.eval_prompts(huge, seed=0, count=64)
    assert len(big_held) == 64 and not {p.text for p in big_held} & {p.text for p in
                                                                      task.generate_prompts(huge, 0, 20_000)}
    assert task.eval_prompts(task.parse_params({"held_out": 0}), seed=0, count=64) == []
    with pytest.raises(TaskError, match="every one of the 1 problems is held out"):
        task.generate_prompts(task.parse_params({"max_operand": 0, "held_out": 0.99}), seed=0, count=1)


def test_arithmetic_prompts_are_seeded_and_verifiable():
    task = get_task("arithmetic")
    params = task.parse_params(DEMO_DEFAULTS["task_params"])
    a = task.generate_prompts(params, seed=7, count=50)
    assert a == task.generate_prompts(params, seed=7, count=50)
    assert a != task.generate_prompts(params, seed=8, count=50)
    for p in a:
        x, y = p.text.rstrip("=").split("+")
        assert 0 <= int(x) <= 4 and 0 <= int(y) <= 4 and p.reference == str(int(x) + int(y))
    assert len(task.all_prompts(params)) == 25
    assert len(task.all_prompts(params, held=False)) + len(task.all_prompts(params, held=True)) == 25
    prompt = TaskPrompt(text="3+4=", reference="7")
    assert task.reward(prompt, "7", params) == 1.0
    assert task.reward(prompt, "x7", params) == 1.0  # junk around the final answer is not penalised
    assert task.reward(prompt, "77", params) == 0.0
    assert task.reward(prompt, "7 8", params) == 0.0  # the final answer is the last number
    assert task.reward(prompt, "", params) == 0.0
    q = task.parse_params({"ops": ["-", "*"], "style": "question", "max_operand": 9})
    for p in task.generate_prompts(q, seed=1, count=20):
        assert p.text.startswith("what is ") and p.text.endswith("?\n")
    with pytest.raises(TaskError, match="generates its own prompts"):
        task.prompt_from_item({"question": "x"}, params)


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("so 3 + 4 = 7", "7"),
        ("... #### 1,234", "1,234"),
        ("blah #### -5\n", "-5"),
        ("we get \\boxed{\\frac{1}{2}} hmm \\boxed{42}", "42"),
        ("the answer is: $3.50. Later 9", "$3.50"),
        ("The Answer is 12 apples", "12"),
        ("result 3/4", "3/4"),
        ("5-3", "3"),
        ("no number here", None),
        ("up by 50% today", "50%"),
    ],
)
def test_final_answer_extraction(text, answer):
    assert extract_final_answer(text) == answer


@pytest.mark.parametrize(
    ("a", "b", "equal"),
    [
        ("1,234", "1234", True),
        ("3.50", "3.5", True),
        ("$5", "5", True),
        ("0.5", "1/2", True),
        ("-7", "-7.0", True),
        ("-7", "7", False),
        ("0.3333333", "1/3", True),  # within rel_tol
        ("0.33", "1/3", False),
        ("1/0", "1", False),
        (None, "1", False),
        ("abc", "abc", False),
        ("9" * 400, "18", False),  # a float() of it would overflow
        ("1" + "0" * 400, "1" + "0" * 400, True),
    ],
)
def test_numeric_equivalence(a, b, equal):
    assert numbers_equal(a, b) is equal
    assert parse_number("2,000.25") == parse_number("8001/4")


def test_an_answer_with_a_huge_exponent_is_no_number_and_costs_nothing():
    """`#### ,1e,9,9,9,9,9,9,9,9,9` (26 tokens of a worker's completion) reached Fraction("1e999999999"), which
    builds that power of ten: hours of the learner's step. An exponent beyond 400 is no number now."""
    task = get_task("arithmetic")
    prompt = TaskPrompt(text="What is 2 + 2?", reference="4")
    started = time.process_time()
    assert task.reward(prompt, "#### ,1e," + ",".join("999999999"), task.parse_params({})) == 0.0
    assert parse_number("1e999999999") is None and parse_number("1e401") is None
    assert time.process_time() - started < 1.0
    assert parse_number("1e3") == 1000 and parse_number("2.5e-1") == parse_number("1/4")


def test_gsm8k_items_and_reward():
    task = get_task("gsm8k")
    params = task.parse_params({})
    item = {"question": "Tom has 3 apples and buys 1,197 more. How many?", "answer": "3 + 1197 = 1200\n#### 1,200"}
    prompt = task.prompt_from_item(item, params)
    assert prompt.reference == "1,200" and "Tom has 3 apples" in prompt.text
    assert task.reward(prompt, "3+1197 = 1200.\n#### 1200", params) == 1.0
    assert task.reward(prompt, "The answer is $1,200.00", params) == 1.0
    assert task.reward(prompt, "I think \\boxed{1200}", params) == 1.0
    assert task.reward(prompt, "3 + 1197 = 1201", params) == 0.0
    assert task.prompt_from_item({"question": "q", "answer": 42}, params).reference == "42"
    with pytest.raises(TaskItemError, match="missing key 'answer'") as exc:
        task.prompt_from_item({"question": "q", "solution": "1"}, params)
    assert "question, solution" in str(exc.value)
    with pytest.raises(TaskItemError, match="no numeric final answer"):
        task.prompt_from_item({"question": "q", "answer": "unknown"}, params)
    custom = task.parse_params({"question_key": "q", "answer_key": "a", "template": "Q: {question}\nA:"})
    assert task.prompt_from_item({"q": "1+1?", "a": "2"}, custom).text == "Q: 1+1?\nA:"
    with pytest.raises(TaskParamsError, match="template"):
        task.parse_params({"template": "no placeholder"})
    with pytest.raises(TaskError, match="reads its prompts from a dataset"):
        task.generate_prompts(params, 0, 1)


def test_exact_match_options():
    task = get_task("exact_match")
    prompt = task.prompt_from_item({"prompt": "Capital of France?", "reference": "Paris"}, task.parse_params({}))
    strict = task.parse_params({})
    assert task.reward(prompt, " Paris\n", strict) == 1.0  # strip is on by default
    assert task.reward(prompt, "paris", strict) == 0.0
    assert task.reward(prompt, "paris", task.parse_params({"case_sensitive": False})) == 1.0
    assert task.reward(prompt, " Paris", task.parse_params({"strip": False})) == 0.0
    spaced = TaskPrompt(text="x", reference="New  York")
    assert task.reward(spaced, "New York", task.parse_params({"collapse_whitespace": True})) == 1.0
    with pytest.raises(TaskItemError, match="missing key 'reference'"):
        task.prompt_from_item({"prompt": "x"}, strict)


def test_regex_options():
    task = get_task("regex")
    per_item = task.parse_params({})
    prompt = task.prompt_from_item({"prompt": "Say a year", "reference": r"\b(19|20)\d\d\b"}, per_item)
    assert task.reward(prompt, "It was 1999.", per_item) == 1.0
    assert task.reward(prompt, "It was 1899.", per_item) == 0.0
    full = task.parse_params({"pattern": "yes|no", "mode": "fullmatch", "ignore_case": True})
    fixed = task.prompt_from_item({"prompt": "Answer yes or no"}, full)
    assert task.reward(fixed, " YES ", full) == 1.0
    assert task.reward(fixed, "yes, sure", full) == 0.0
    with pytest.raises(TaskParamsError, match="not a valid regular expression"):
        task.parse_params({"pattern": "(unclosed"})
    with pytest.raises(TaskItemError, match="not a regex"):
        task.prompt_from_item({"prompt": "x", "reference": "[bad"}, per_item)
    with pytest.raises(TaskParamsError, match="no backreferences or lookarounds"):
        task.parse_params({"pattern": r"(a)\1"})


def test_a_regex_runs_in_linear_time_on_a_workers_text():
    """With backtracking, (a+)+$ on 'aaa...b' takes time exponential in its length: hours at 40 characters."""
    task = get_task("regex")
    params = task.parse_params({"pattern": "(a+)+$"})
    prompt = task.prompt_from_item({"prompt": "x"}, params)
    start = time.monotonic()
    assert task.reward(prompt, "a" * 20_000 + "b", params) == 0.0
    assert time.monotonic() - start < 5.0


class _Verifier(BaseHTTPRequestHandler):
    """A user's reward endpoint. Behaviour is chosen by the completion text."""

    calls: list[dict] = []
    flaky_left = 0

    def do_POST(self) -> None:  # noqa: N802 (http.server API)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).calls.append(body)
        mode = body["completion"]
        if mode == "flaky" and type(self).flaky_left > 0:
            type(self).flaky_left -= 1
            return self._reply(503, b"busy", {"Retry-After": "0"})
        if mode == "slow":
            time.sleep(1.0)
        replies = {
            "garbage": b"not json",
            "nan": b"NaN",
            "string": b'{"reward": "high"}',
            "bare": b"0.25",
        }
        if mode == "missing":
            return self._reply(404, b"{}")
        if mode == "broken":
            return self._reply(500, b"{}")
        payload = replies.get(mode, json.dumps({"reward": 1.0 if mode == body["reference"] else 0.0}).encode())
        self._reply(200, payload)

    def _reply(self, status: int, payload: bytes, headers: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        with contextlib.suppress(BrokenPipeError):  # the client timed out first (the "slow" case)
            self.wfile.write(payload)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def verifier_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Verifier)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Verifier.calls = []
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/reward"
    finally:
        server.shutdown()
        server.server_close()


def test_http_reward_against_a_real_server(verifier_url, caplog):
    task = get_task("http_reward")
    # A generous timeout for the counted calls: a stalled request would be retried and miscounted.
    params = task.parse_params({"url": verifier_url, "timeout_s": 5, "max_retries": 2, "backoff_s": 0.01})
    prompt = task.prompt_from_item({"prompt": "say hi", "reference": "hi"}, params)
    assert task.reward(prompt, "hi", params) == 1.0
    assert _Verifier.calls[-1] == {"prompt": "say hi", "completion": "hi", "reference": "hi"}
    assert task.reward(prompt, "ho", params) == 0.0
    assert task.reward(prompt, "bare", params) == 0.25

    _Verifier.flaky_left = 2  # two 503s, then an answer: retried
    n = len(_Verifier.calls)
    assert task.reward(prompt, "flaky", params) == 0.0
    assert len(_Verifier.calls) == n + 3

    for bad, why in (("garbage", "not a finite number"), ("nan", "not a finite number"),
                     ("string", "'{\"reward\": \"high\"}', not a finite number"), ("missing", "answered HTTP 404")):
        n = len(_Verifier.calls)
        with pytest.raises(ScoringError, match=why):
            task.reward(prompt, bad, params)
        assert len(_Verifier.calls) == n + 1  # not retried
    n = len(_Verifier.calls)
    with pytest.raises(ScoringError, match=r"gave no answer after 3 tries: HTTP 5\d\d"):
        task.reward(prompt, "broken", params)
    assert len(_Verifier.calls) == n + 3  # 5xx: retried max_retries times, then given up
    started = time.perf_counter()
    hasty = task.parse_params({"url": verifier_url, "timeout_s": 0.3, "max_retries": 2, "backoff_s": 0.01})
    with pytest.raises(ScoringError, match="gave no answer after 3 tries"):  # timeout: 3 tries of 0.3 s, not
        task.reward(prompt, "slow", hasty)  # 3 of the 1 s answer
    assert time.perf_counter() - started < 2.9
    assert any("giving up" in r.getMessage() for r in caplog.records)
    assert any("not a finite number" in r.getMessage() for r in caplog.records)


def test_http_reward_unreachable_and_bad_params():
    task = get_task("http_reward")
    params = task.parse_params({"url": "http://127.0.0.1:9/x", "timeout_s": 0.2, "max_retries": 1, "backoff_s": 0})
    with pytest.raises(ScoringError, match="ConnectError"):
        task.reward(TaskPrompt(text="p"), "c", params)
    for bad in ({"url": "ftp://example.com/x"}, {"url": "not a url"}, {}, {"url": "http://h.io", "max_retries": 9}):
        with pytest.raises(TaskParamsError):
            task.parse_params(bad)
    no_ref = task.prompt_from_item({"prompt": "p"}, task.parse_params({"url": "http://h.io/r"}))
    assert no_ref.reference is None



class _Hostile(BaseHTTPRequestHandler):
    """An endpoint its owner turned against the platform: /huge sends 50 MB, /drip a byte every 0.1 s."""

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", str(50_000_000))
        self.end_headers()
        with contextlib.suppress(OSError):  # the client gave up, as it should
            for _ in range(50_000 if self.path == "/huge" else 0):
                self.wfile.write(b"0" * 1000)
            for _ in range(100_000 if self.path == "/drip" else 0):
                self.wfile.write(b"0")
                self.wfile.flush()
                time.sleep(0.1)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def hostile_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hostile)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("name", ["http_env", "http_reward"])
def test_an_endpoint_that_sends_too_much_or_drips_is_cut_off(hostile_url, name):
    """A reply is read up to 64 KiB and each try ends at timeout_s, body included: neither holds the caller's
    thread or memory (httpx's own timeout is per read, which a byte every 0.1 s never trips)."""
    task = get_task(name)
    prompt = TaskPrompt(text="p", reference="r")
    for path, why, most_s in (("/huge", "more than 65536 bytes", 5.0), ("/drip", "deadline of 0.5 s", 2.5)):
        params = task.parse_params({"url": hostile_url + path, "timeout_s": 0.5, "max_retries": 1, "backoff_s": 0})
        started = time.monotonic()
        if name == "http_env":
            with pytest.raises(TaskError, match=why):
                task.new_episode(prompt, params).step("guess")
        else:
            with pytest.raises(ScoringError, match=why):
                task.reward(prompt, "c", params)
        assert time.monotonic() - started < most_s, path

def test_guess_number_is_a_real_multi_turn_episode():
    task = get_task("guess_number")
    assert task.multi_turn
    params = task.parse_params({"low": 1, "high": 100, "max_turns": 7})
    prompts = task.generate_prompts(params, seed=3, count=10)
    assert prompts == task.generate_prompts(params, seed=3, count=10)

    def bisect(transcript):  # a policy that reads the environment's hints
        lo, hi = 1, 100
        for (_, said), (_, heard) in zip(transcript[1::2], transcript[2::2], strict=False):
            guess = int(said)
            lo, hi = (guess + 1, hi) if heard.startswith("higher") else (lo, guess - 1)
        return str((lo + hi) // 2)

    for prompt in prompts:
        result = run_episode(task.new_episode(prompt, params), bisect)
        assert result.reward == 1.0
        assert result.transcript[0] == ("user", "guess my number between 1 and 100.\n")
        assert result.transcript[-1][1] == prompt.reference
    stubborn = run_episode(task.new_episode(prompts[0], params), lambda t: "no idea")
    assert stubborn.reward == 0.0 and len(stubborn.transcript) == 1 + 2 * 7 - 1
    assert task.reward(prompts[0], f"it is {prompts[0].reference}", params) == 1.0


def test_single_turn_tasks_have_no_episode():
    task = get_task("arithmetic")
    assert task.new_episode(TaskPrompt(text="1+1=", reference="2"), task.parse_params({})) is None


def test_task_params_base_forbids_extra_keys():
    with pytest.raises(ValueError):
        TaskParams.model_validate({"anything": 1})
