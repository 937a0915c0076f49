"""A GenRM reward function in verl's reward-loop form (docs/advance/reward_loop.rst): the
problem and the response go into a grading prompt, the judge is asked through
``reward_router_address`` with aiohttp, and the last line of its answer is parsed as a
score from 1 to 10 (an answer that does not parse scores 0 and is counted)."""

import json

import aiohttp

GRADING = ("Grade the solution to the problem from 1 to 10.\n\nProblem:\n{problem}\n\nSolution:\n{solution}\n\n"
           "Answer with the score alone.")


async def ask_judge(router_address: str, request: dict) -> dict:
    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://{router_address}/v1/chat/completions", json=request) as resp:
            return json.loads(await resp.text())


async def compute_score(data_source, solution_str, ground_truth, extra_info, reward_router_address,
                        reward_model_tokenizer, **kwargs):
    question = (extra_info or {}).get("question", "")
    request = {"messages": [{"role": "user", "content": GRADING.format(problem=question, solution=solution_str)}],
               "temperature": 0.7, "top_p": 0.9, "max_tokens": 8, "seed": 7}
    answer = await ask_judge(reward_router_address, request)
    content = answer["choices"][0]["message"]["content"]
    try:
        score = int(content.strip().splitlines()[-1].strip())
        parsed = 1.0
    except (ValueError, IndexError):
        score, parsed = 0, 0.0
    return {"score": score / 10, "judge_parsed": parsed, "judge_answer": content}
