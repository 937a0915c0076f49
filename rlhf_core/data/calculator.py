"""The built-in tool task: multiply two 3-digit numbers. Prompt ``"123*456"`` -> the
product, ``"56088"``. A 2-layer model cannot multiply; with the calculator tool it only has
to copy: the numbers into a call, the tool's answer into its own. Reward 1 when the
response's final answer (after the last tool answer) is the product, else 0
(``rlhf agent-demo``; its model is ``rlhf_core/models/calculator.py``)."""

from __future__ import annotations

import random
import re

DATA_SOURCE = "builtin/calculator"
CALL_HEAD = '{"name": "calculator", "arguments": {"expression": "'
CALL_TAIL = '"}}'
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", CALL_HEAD, CALL_TAIL]
VOCAB = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "=": 3, "*": 4, **{str(d): 5 + d for d in range(10)},
         **{t: 15 + i for i, t in enumerate(TOOL_TOKENS)}}
#: the chat as this model reads it: a user turn is "<bos>a*b=", a tool answer is wrapped
#: in its tags, an assistant turn ends with <eos>; the tools' schemas are not rendered
#: (the model knows its one tool)
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ '<bos>' + m['content'] + '=' }}"
                 "{% elif m['role'] == 'tool' %}{{ '<tool_response>' + m['content'] + '</tool_response>' }}"
                 "{% elif m['role'] == 'assistant' %}{{ m['content'] + '<eos>' }}{% endif %}{% endfor %}")
TOOL_SCHEMA = {"type": "function", "function": {
    "name": "calculator", "description": "the value of an arithmetic expression",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def final_answer(solution_str: str) -> str:
    """The digits the response ends with: after its last tool answer, if any."""
    tail = solution_str.rsplit("</tool_response>", 1)[-1]
    return "".join(re.findall(r"\d", tail))


def reward_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    correct = final_answer(solution_str) == str(ground_truth)
    return {"score": float(correct), "used_tool": float("</tool_response>" in solution_str)}


def make_rows(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        rows.append({"prompt": [{"role": "user", "content": f"{a}*{b}"}], "ground_truth": str(a * b),
                     "data_source": DATA_SOURCE, "extra_info": {"index": i}})
    return rows
