"""math-verify behind a process pool (tasks/verify.py), side by side with our own answer parser."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import threading
import time

import pytest

from tasks import TaskPrompt, get_task
from tasks.answers import extract_final_answer, numbers_equal
from tasks.verify import math_equal, numeric_answer_equal

HOSTILE = "\\boxed{10^{10^{10^{10}}}}"  # keeps sympy busy for minutes

# (completion, reference, our parser, math_equal, what gsm8k now pays). None: math-verify cannot decide.
TABLE = [
    ("The answer is 42", "42", True, True, True),
    ("\\boxed{42}", "42", True, True, True),
    ("42.0", "42", True, True, True),
    ("#### 42", "42", True, True, True),
    ("forty two", "42", False, None, False),
    ("-7", "-7", True, True, True),
    ("- 7", "-7", False, False, False),
    ("\u22127", "-7", False, None, False),  # a Unicode minus
    ("3/4", "0.75", True, True, True),
    ("0.75", "3/4", True, True, True),
    ("1,000", "1000", True, True, True),
    ("43 or 42", "42", True, True, True),  # both take the last number
    ("42 or 43", "42", False, False, False),
    ("The answer is 43. Actually 42", "42", False, False, False),
    ("", "42", False, None, False),
    # Where they differ. LaTeX our parser cannot read:
    ("\\frac{3}{4}", "3/4", False, True, True),
    ("The answer is \\frac{3}{4}", "0.75", False, True, True),
    ("\\boxed{1{,}000}", "1000", False, True, True),
    ("\\boxed{4.2 \\times 10^{1}}", "42", False, True, True),
    # Hedges our parser pays for (it reads the first number in the box):
    ("\\boxed{42 \\pm 1}", "42", True, False, False),
    ("\\boxed{42 \\text{ or } 43}", "42", True, False, False),
    # Plain numbers: the task keeps our parser (rel_tol is defined on it; "75%" is 75 to it).
    ("75%", "3/4", False, True, False),
    ("42.000001", "42", True, False, True),
    # Where the final answer is: the task follows our precedence ("####" first, then the last box).
    ("#### 43 \\boxed{42}", "42", False, True, False),
    ("#### 42\n\nQuestion: Tom has 5 apples", "42", True, False, True),
    ("\\boxed{43}\\boxed{42}", "42", True, False, True),  # math-verify reads all boxes as one set
]


@pytest.mark.parametrize(("completion", "reference", "ours", "mv", "task"), TABLE)
def test_both_parsers_on_the_same_answers(completion, reference, ours, mv, task):
    assert numbers_equal(extract_final_answer(completion), reference) is ours
    assert math_equal(completion, reference) is mv
    assert numeric_answer_equal(completion, reference) is task
    gsm8k = get_task("gsm8k")
    assert gsm8k.reward(TaskPrompt(text="q", reference=reference), completion, gsm8k.parse_params({})) == float(task)


def test_where_the_two_parsers_differ():
    differ = {c: (ours, mv) for c, _, ours, mv, _ in TABLE if ours is not bool(mv)}
    assert differ == {
        "\\frac{3}{4}": (False, True),
        "The answer is \\frac{3}{4}": (False, True),
        "\\boxed{1{,}000}": (False, True),
        "\\boxed{4.2 \\times 10^{1}}": (False, True),
        "\\boxed{42 \\pm 1}": (True, False),
        "\\boxed{42 \\text{ or } 43}": (True, False),
        "75%": (False, True),
        "42.000001": (True, False),
        "#### 43 \\boxed{42}": (False, True),
        "#### 42\n\nQuestion: Tom has 5 apples": (True, False),
        "\\boxed{43}\\boxed{42}": (True, False),
    }


def test_a_hostile_answer_is_cut_off_and_the_next_call_works():
    assert math_equal("1", "1") is True  # the pool is warm: its start is not charged to a call
    hung = {p.pid for p in multiprocessing.active_children()}
    start = time.monotonic()
    assert math_equal(HOSTILE, "42", timeout_s=1.0) is None
    assert time.monotonic() - start < 1.0 + 2.0
    assert math_equal("\\frac{84}{2}", "42") is True
    fresh = {p.pid for p in multiprocessing.active_children()}
    assert len(fresh) == 1 and not fresh & hung  # the hung worker was killed, not left behind
    gsm8k = get_task("gsm8k")
    start = time.monotonic()
    reward = gsm8k.reward(TaskPrompt(text="q", reference="42"), f"so {HOSTILE}", gsm8k.parse_params({}))
    assert reward == 0.0 and time.monotonic() - start < 2.0 + 2.0  # the task's own limit is 2 s
    assert math_equal("0.75", "3/4") is True


def test_math_equal_works_off_the_main_thread():
    cases = [("0.75", "3/4", True), ("\\frac{84}{2}", "42", True), ("43", "42", False), ("forty two", "42", None)]
    results: dict[int, bool | None] = {}
    threads = [
        threading.Thread(target=lambda i=i, c=c, r=r: results.__setitem__(i, math_equal(c, r)))
        for i, (c, r, _) in enumerate(cases)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results == {i: expected for i, (_, _, expected) in enumerate(cases)}


def test_long_completions_are_checked_on_their_tail():
    assert math_equal("x " * 100_000 + "\\frac{84}{2}", "42") is True


def test_the_control_plane_does_not_import_math_verify():
    code = "import sys, tasks; assert 'math_verify' not in sys.modules and 'sympy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
