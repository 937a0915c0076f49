"""The GSM8K answer convention: a solution ends with ``#### <number>``; the reward is 1 when
that number equals the ground truth, 0 otherwise (``reward.function=gsm8k``)."""

from __future__ import annotations

import re

# the last "####", then an optional currency sign, then a number with optional thousands
# separators and decimals ("#### 1,234.50", "####$18", "#### -3")
_ANSWER = re.compile(r"####\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")


def normalize_number(text: str) -> str | None:
    """``"1,234.50"`` -> ``"1234.5"``; None when ``text`` is not a number."""
    cleaned = text.strip().replace(",", "").replace("$", "")
    try:
        value = float(cleaned)
    except ValueError:
        return None
    return str(int(value)) if value.is_integer() else repr(value)


def extract_answer(solution_str: str) -> str | None:
    """The number after the solution's last ``####`` (None: no such marker)."""
    found = _ANSWER.findall(solution_str)
    return normalize_number(found[-1]) if found else None


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    """verl's reward signature; ``formatted`` says whether a final answer was found at all."""
    answer = extract_answer(solution_str)
    truth = normalize_number(str(ground_truth).split("####")[-1])
    return {"score": float(answer is not None and answer == truth), "formatted": float(answer is not None)}
