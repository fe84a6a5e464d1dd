"""Money as a user reads it (no pydantic here: the CLI's help imports it)."""

from __future__ import annotations


def usd(amount: float) -> str:
    """Dollars: cents when the amount is whole cents, else four decimals, as costs are shown (a budget of $0.004,
    or a few seconds of compute, is not "$0.00")."""
    cents = abs(round(amount, 2) - amount) < 1e-9  # 0.1 + 0.2 is whole cents, within float noise
    return f"${amount:.2f}" if cents else f"${amount:.4f}"
