"""Math answers checked with math-verify (the checker verifiers users trust), safe against hostile text.

Completions come from untrusted workers, and math-verify (sympy underneath) can be made to hang: a
crafted `\\boxed{10^{10^{10^{10}}}}` runs for minutes. Its own timeouts use signal.alarm, which raises
outside the main thread (the learner may score in one) and cannot interrupt a long C call. So each
check runs in a one-worker process pool under a hard wall-clock limit; on timeout the worker is
killed, a fresh one is started, and the caller gets None ("could not decide") within `timeout_s`.

The worker is forked (where the platform can) after math_verify is imported and warmed here, so a
first or replacement worker is ready in milliseconds and imports nothing itself; it runs only
math-verify, never the torch or threads it inherits. 'forkserver' and 'spawn' were measured and
rejected: their workers re-import the caller's `__main__` (for the learner, torch), seconds per worker
start. math_verify is imported on the first call only, to keep `tasks` light for the control
plane.

`numeric_answer_equal` is the policy of the numeric tasks. The final answer is located once
(`answer_span`): after "####", else in the last \\boxed{}, by the precedence of tasks/answers.py;
only free text with neither is left to math-verify's own extraction. A plain number is judged by our
parser, which covers it fully and is what `rel_tol` is defined on; anything else (LaTeX such as
\\frac{3}{4}, words around the number) by math-verify, and by our parser only when math-verify cannot
decide. One checker judges one answer, so a completion cannot offer two ("#### 43 ... \\boxed{42}")
and be paid when either is right, and no answer scores worse than before for lack of a parse.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import multiprocessing
import re
import threading

from tasks.answers import NUMBER_RE, extract_final_answer, numbers_equal

MAX_COMPLETION_CHARS = 4_000  # the final answer is at the end: longer texts are checked on their tail
MAX_REFERENCE_CHARS = 1_000
_WARMUP_TIMEOUT_S = 30.0  # a worker's first check, not charged to a call (milliseconds once forked)
_BOXED = "\\boxed{"
_ANSWER_END = re.compile(r"[\s.,;:!?)]|$")  # "#### 42 apples" is 42, but "#### 4^{2}" is not 4

_lock = threading.Lock()
_pool: cf.ProcessPoolExecutor | None = None


def _quiet() -> None:
    """math-verify warns once per process that its timeouts are off: ours replace them, by design."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)


def _check(completion: str, reference: str) -> bool | None:
    """Runs in the worker. Timeouts off: signals are not needed there, the parent enforces the limit."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    gold = parse(f"{_BOXED}{reference}}}", parsing_timeout=None)  # bare LaTeX gold only parses boxed
    config = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())
    pred = parse(completion, config, parsing_timeout=None)
    if not gold or not pred:
        return None
    return bool(verify(gold, pred, timeout_seconds=None))


def _get_pool() -> cf.ProcessPoolExecutor:
    """The worker pool, started (and warmed, outside any call's time limit) on first use."""
    global _pool
    if _pool is None:
        _quiet()
        _check("1", "1")  # imports math_verify and fills its regex caches here, for every forked worker
        fork = "fork" in multiprocessing.get_all_start_methods()
        context = multiprocessing.get_context("fork" if fork else None)
        pool = cf.ProcessPoolExecutor(max_workers=1, mp_context=context, initializer=_quiet)
        try:
            pool.submit(_check, "1", "1").result(timeout=_WARMUP_TIMEOUT_S)
        except BaseException:
            _kill(pool)
            raise
        _pool = pool
    return _pool


def _kill(pool: cf.ProcessPoolExecutor) -> None:
    """Kill the workers (a hung sympy call ignores anything gentler) and drop the pool.
    `_processes` is private, but Python 3.11 offers no public way (3.14 adds `kill_workers`)."""
    for process in list((getattr(pool, "_processes", None) or {}).values()):
        process.kill()
    pool.shutdown(wait=False, cancel_futures=True)


def math_equal(completion: str, reference: str, *, timeout_s: float = 2.0) -> bool | None:
    """Whether math-verify finds the completion's answer equal to `reference`; None if it cannot decide.

    None covers: no parsable answer on either side, the time limit, a crashed worker. Never raises
    for a hostile completion, and returns within `timeout_s` once the pool is warm; safe from any thread.
    """
    global _pool
    completion, reference = completion[-MAX_COMPLETION_CHARS:], reference[:MAX_REFERENCE_CHARS]
    with _lock:  # one check at a time, so a call's limit is never spent waiting for another's
        try:
            future = _get_pool().submit(_check, completion, reference)
            return future.result(timeout=timeout_s)
        except Exception:  # the time limit, a broken pool or a worker error: start afresh next time
            if _pool is not None:
                _kill(_pool)
            _pool = None
            return None


def answer_span(text: str) -> str:
    """The text of the final answer, located as answers.py does: after the last "####" (the number it
    starts with, as today, else its first line), else the last \\boxed{...} (kept boxed, so math-verify
    reads it as LaTeX), else the whole tail."""
    text = text[-MAX_COMPLETION_CHARS:]
    if "####" in text:
        line = text.rsplit("####", 1)[1].strip().split("\n", 1)[0].strip()
        number = NUMBER_RE.match(line)
        return number.group(0) if number and _ANSWER_END.match(line, number.end()) else line
    start = text.rfind(_BOXED)
    if start >= 0:
        depth = 0
        for end in range(start + len(_BOXED), len(text)):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            if depth < 0:
                return text[start : end + 1]
    return text


def is_plain_number(span: str) -> bool:
    """A single number our parser reads in full ("1,200", "$3.50", "-7", "3/4", "50%"), boxed or not."""
    if span.startswith(_BOXED) and span.endswith("}"):
        span = span[len(_BOXED) : -1]
    return NUMBER_RE.fullmatch(span.strip().rstrip(".").strip()) is not None


def numeric_answer_equal(completion: str, reference: str, *, rel_tol: float = 1e-6, timeout_s: float = 2.0) -> bool:
    """The numeric tasks' verdict (see the module docstring): math-verify unless the answer is a plain
    number or math-verify cannot decide, then our parser."""
    span = answer_span(completion)
    if not is_plain_number(span):
        verdict = math_equal(span, reference, timeout_s=timeout_s)
        if verdict is not None:
            return verdict
    return numbers_equal(extract_final_answer(completion), reference, rel_tol=rel_tol)
