"""verl's default reward (``verl.utils.reward_score.default_compute_score``): the scorer is
chosen by each row's ``data_source``, with verl's rules and results, here
``reward.function=verl`` (the default). A ``data_source`` no scorer here takes is refused
before any worker is placed (``scorer_for``), never scored by something else.

| data_source | scorer |
|---|---|
| ``openai/gsm8k`` | the number after the last ``#### `` (in the last 300 characters), equal to the ground truth as written (commas and ``$`` dropped): 1, else 0 |
| ``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval``, ``HuggingFaceH4/MATH-500`` | the last ``\\boxed{}`` equal to the ground truth in MATH's canonical form (``math_answers``) |
| ``searchR1_*`` (nq, triviaqa, popqa, hotpotqa, 2wikimultihopqa, musique, bamboogle) | the last ``<answer>...</answer>`` an exact match (SQuAD normalization) of one of ``ground_truth["target"]``; a quarter when the response repeats the answer tags more than 10 times |
| ``codecontests``, ``apps``, ``codeforces``, ``taco`` | SandboxFusion (``reward_model.sandbox_fusion.url``) |
| the built-in tasks' | ``rlhf_core.data.builtin.reward_score``, ``rlhf_core.data.calculator.reward_score`` |
"""

from __future__ import annotations

import re
import string

from rlhf_core.data import builtin, calculator, math_answers

MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
SEARCH_R1_SOURCES = tuple(f"searchR1_{name}" for name in ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa",
                                                           "musique", "bamboogle"))
CODE_SOURCES = ("codecontests", "apps", "codeforces", "taco")
_DAPO = ("verl's math_dapo scorer (Minerva's answer normalization) is not built here; set "
         "custom_reward_function.path to a scorer of yours")
#: data sources verl scores that are not scored here yet, and what would score them
NOT_HERE = {
    **{s: _DAPO for s in ("math_dapo", "math", "math_dapo_reasoning")},
    **{s: "verl's prime_math scorer is not built here; set custom_reward_function.path to a scorer of yours"
       for s in ("numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc",
                 "numina_cn_k12", "numina_olympiads")},
    "hiyouga/geometry3k": "verl's geometry3k scorer (mathruler) is not built here; set custom_reward_function.path",
}
_GSM8K_TAIL = 300
_PUNCTUATION = set(string.punctuation)


class UnscoredSource(ValueError):
    """A data_source nothing here scores (one line: the source and what would score it)."""


def gsm8k_score(solution_str: str, ground_truth) -> float:
    found = re.findall(r"#### (\-?[0-9\.\,]+)", solution_str[-_GSM8K_TAIL:])
    if not found:
        return 0.0
    return float(found[-1].replace(",", "").replace("$", "") == ground_truth)


def _normalized(text: str) -> str:
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def search_r1_score(solution_str: str, ground_truth) -> float:
    answers = re.findall(r"<answer>(.*?)</answer>", solution_str, re.DOTALL)
    if not answers:
        return 0.0
    targets = ground_truth.get("target") if isinstance(ground_truth, dict) else None
    if targets is None:
        raise ValueError(f"searchR1 ground_truth: expected {{'target': [answers]}}; found {ground_truth!r}"[:200])
    targets = [targets] if isinstance(targets, str) else list(targets)
    said = _normalized(answers[-1].strip())
    if not any(_normalized(str(t)) == said for t in targets):
        return 0.0
    repeated = solution_str.count("<answer>") > 10 or solution_str.count("</answer>") > 10
    return 0.25 if repeated else 1.0


def scorer_for(data_source: str, sandbox: bool = False):
    """The scorer of ``data_source`` (``sandbox``: a SandboxFusion URL is set, which the
    reward worker routes the code sources to); ``UnscoredSource`` naming what would score it."""
    if data_source == "openai/gsm8k":
        return lambda s, gt, extra: gsm8k_score(s, gt)
    if data_source in MATH_SOURCES:
        return lambda s, gt, extra: math_answers.compute_score(s, gt)
    if data_source in SEARCH_R1_SOURCES:
        return lambda s, gt, extra: search_r1_score(s, gt)
    if data_source == builtin.DATA_SOURCE:
        return lambda s, gt, extra: builtin.reward_score(data_source, s, gt, extra)
    if data_source == calculator.DATA_SOURCE:
        return lambda s, gt, extra: calculator.reward_score(data_source, s, gt, extra)
    if data_source in CODE_SOURCES:
        if sandbox:
            return None  # the reward worker's SandboxFusion router scores it; this function is never asked
        raise UnscoredSource(f"data_source {data_source!r}: scored by running the code on its test cases; expected "
                             f"reward_model.sandbox_fusion.url (a SandboxFusion server); found none")
    if data_source in NOT_HERE or data_source.startswith("aime"):
        raise UnscoredSource(f"data_source {data_source!r}: {NOT_HERE.get(data_source, _DAPO)}")
    raise UnscoredSource(f"data_source {data_source!r}: no scorer of verl's default reward takes it (gsm8k, MATH, "
                         f"searchR1, code through SandboxFusion, the built-in task); set custom_reward_function.path "
                         f"or reward.function")


def default_compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's default reward: the row's ``data_source`` chooses the scorer."""
    return scorer_for(data_source)(solution_str, ground_truth, extra_info)
