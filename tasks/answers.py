"""Final-answer extraction and numeric equivalence, shared by the numeric tasks.

The final answer of a completion is, in order of precedence:
  1. what follows the last "####" (GSM8K style),
  2. the content of the last \\boxed{...},
  3. what follows the last "answer is" (case-insensitive),
  4. otherwise the last number in the text.
In cases 1-3 the first number of that span is taken when there is one. Numbers may carry thousands
commas, decimals, a sign, a leading $ or trailing %, or be fractions "a/b"; two answers are equal when
their values are (exactly for fractions/decimals, else within a relative tolerance).
"""

from __future__ import annotations

import re
from fractions import Fraction

_NUM = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+"
# Not preceded by a digit, '.' or ',' so that "1,234" and "5-3" are not split into odd pieces.
NUMBER_RE = re.compile(rf"(?<![\d.,])-?\$?(?:{_NUM})(?:\s*/\s*(?:{_NUM}))?%?")
_ANSWER_IS = re.compile(r"answer\s+is\s*:?", re.IGNORECASE)
_MAX_CHARS = 20_000  # verifier input bound: longer completions are scored on their tail
DECIMAL = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE]([+-]?\d{1,6}))?")  # Fraction's own syntax, minus _ and spaces
MAX_EXPONENT = 400  # 10**400 is larger than any answer; Fraction builds 10**e whole


def _first_number(span: str) -> str | None:
    match = NUMBER_RE.search(span)
    return match.group(0) if match else None


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def extract_final_answer(text: str) -> str | None:
    """The final answer as a string (see module docstring), or None when there is none."""
    text = text[-_MAX_CHARS:]
    if "####" in text:
        span = text.rsplit("####", 1)[1]
        return _first_number(span) or (span.strip() or None)
    boxed = _last_boxed(text)
    if boxed is not None:
        return _first_number(boxed) or (boxed.strip() or None)
    matches = list(_ANSWER_IS.finditer(text))
    if matches:
        found = _first_number(text[matches[-1].end() :])
        if found is not None:
            return found
    numbers = NUMBER_RE.findall(text)
    return numbers[-1] if numbers else None


def parse_number(text: str | None) -> Fraction | None:
    """'1,234' -> 1234, '-3.50' -> -7/2, '$5' -> 5, '50%' -> 50, '3/4' -> 3/4; None if not a number."""
    if text is None:
        return None
    s = text.strip().replace(",", "").replace("$", "").rstrip("%").replace(" ", "")
    if s.count("/") == 1:
        num, den = s.split("/")
        a, b = parse_number(num), parse_number(den)
        return a / b if a is not None and b else None
    # A decimal, its exponent (if any) bounded: Fraction("1e999999999") builds that power of ten, and a worker's
    # completion of 26 tokens held the learner's step for hours.
    m = DECIMAL.fullmatch(s)
    if m is None or (m.group(1) is not None and abs(int(m.group(1))) > MAX_EXPONENT):
        return None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def numbers_equal(a: str | None, b: str | None, *, rel_tol: float = 1e-6) -> bool:
    x, y = parse_number(a), parse_number(b)
    if x is None or y is None:
        return False
    if x == y:
        return True
    # Exact, in fractions: float() of a completion's 400-digit number raises OverflowError.
    return abs(x - y) <= Fraction(rel_tol) * max(Fraction(1), abs(y))
