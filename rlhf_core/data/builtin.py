"""The built-in task: reverse a string of digits. Prompt ``"3141="`` -> response ``"1413"``;
reward = fraction of positions right, halved when the length is wrong (partial credit, so
the signal is dense from the start). Its model is built on this machine
(``rlhf_core/models/builtin.py``): the vocabulary below is the task's and the model's.
"""

from __future__ import annotations

import random

DATA_SOURCE = "builtin/digits_reverse"
NUM_DIGITS = 4
VOCAB = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "=": 3, **{str(d): 4 + d for d in range(10)}}


def reward_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    """Partial credit for reversing digits: share of correct positions, halved if the
    response has the wrong length. Rows of another task are refused (one line), never
    scored as digits."""
    if data_source != DATA_SOURCE or not ground_truth:
        raise ValueError(f"reward.function=builtin scores the built-in task's rows (data_source {DATA_SOURCE!r}, "
                         f"digits to reverse); found data_source {data_source!r} with ground truth "
                         f"{str(ground_truth)[:40]!r} (use reward.function=verl, gsm8k or a function of yours)")
    answer = "".join(ch for ch in solution_str if ch.isdigit())
    matches = sum(a == b for a, b in zip(answer, ground_truth))
    score = matches / len(ground_truth)
    if len(answer) != len(ground_truth):
        score *= 0.5
    return {"score": score, "exact": float(answer == ground_truth)}


def make_rows(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        digits = "".join(rng.choice("0123456789") for _ in range(NUM_DIGITS))
        rows.append({"prompt": f"{digits}=", "ground_truth": digits[::-1], "data_source": DATA_SOURCE,
                     "extra_info": {"index": i}})
    return rows
