"""Answers to MATH problems (Hendrycks et al. 2021) as verl's default reward compares them:
the last ``\\boxed{...}`` of the response against the ground truth, both put in one
canonical form by the rules of the MATH paper's evaluation (fractions, square roots,
units, degrees, percent and dollar signs, a leading ``x =``). Exact after that: no algebra."""

from __future__ import annotations

import re


def last_boxed(text: str) -> str | None:
    """The last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed x`` up to a ``$``) with its
    braces balanced, as written; None when there is none."""
    if "\\boxed " in text:
        return "\\boxed " + text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    depth = 0
    for end in range(start, len(text)):
        if text[end] == "{":
            depth += 1
        elif text[end] == "}":
            depth -= 1
            if depth == 0:
                return text[start:end + 1]
    return None


def unboxed(boxed: str) -> str | None:
    """The content of ``\\boxed{x}`` / ``\\boxed x``; None for anything else (an ``\\fbox``)."""
    if boxed.startswith("\\boxed "):
        return boxed[len("\\boxed "):]
    if boxed.startswith("\\boxed{") and boxed.endswith("}"):
        return boxed[len("\\boxed{"):-1]
    return None


def _braced_fracs(s: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1b`` -> ``\\frac{1}{b}``, ``\\frac1{72}`` -> ``\\frac{1}{72}``."""
    head, *parts = s.split("\\frac")
    out = [head]
    for part in parts:
        if part.startswith("{"):
            out.append("\\frac" + part)
        elif len(part) < 2:
            return s
        elif part[1] == "{":
            out.append("\\frac{" + part[0] + "}" + part[1:])
        else:
            out.append("\\frac{" + part[0] + "}{" + part[1] + "}" + part[2:])
    return "".join(out)


def _slash_as_frac(s: str) -> str:
    """``3/4`` (two integers, written plainly) -> ``\\frac{3}{4}``."""
    match = re.fullmatch(r"(-?\d+)/(-?\d+)", s)
    if match and s == f"{int(match.group(1))}/{int(match.group(2))}":
        return "\\frac{" + match.group(1) + "}{" + match.group(2) + "}"
    return s


def _braced_sqrt(s: str) -> str:
    """``\\sqrt3`` -> ``\\sqrt{3}``."""
    head, *parts = s.split("\\sqrt")
    if any(not p for p in parts):
        raise ValueError("a square root of nothing")
    return head + "".join("\\sqrt" + (p if p.startswith("{") else "{" + p[0] + "}" + p[1:]) for p in parts)


def canonical(answer: str) -> str:
    s = answer.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac").replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\$", "")
    if "\\text{ " in s:  # units, written after the number
        pieces = s.split("\\text{ ")
        if len(pieces) != 2:
            raise ValueError("more than one unit")
        s = pieces[0]
    s = s.replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s.startswith("."):
        s = "0" + s
    lhs, eq, rhs = s.partition("=")
    if eq and "=" not in rhs and len(lhs) <= 2:  # "x = 5", "k=5"
        s = rhs
    s = _braced_sqrt(s).replace(" ", "")
    s = _braced_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _slash_as_frac(s)


def equivalent(a: str, b: str) -> bool:
    try:
        return canonical(a) == canonical(b)
    except (ValueError, IndexError):
        return a == b


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 when the response's last boxed answer equals the ground truth in canonical form."""
    boxed = last_boxed(solution_str)
    answer = unboxed(boxed) if boxed is not None else None
    return float(answer is not None and equivalent(answer, str(ground_truth)))
