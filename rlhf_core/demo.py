"""A short, real walk of one batch through the DataProto contract on a local Ray head.

This is what ``rlhf run`` does until the PPO trainer exists: it shows the pipeline
operations a PPO iteration performs (repeat for n samples, chunk per worker, remote
compute, concat, union) on real Ray actors, over the pickle-free wire.
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid

import numpy as np
import torch

from rlhf_core.protocol import DataProto, object_column

PROMPTS = [  # (prompt, ground truth)
    ("2 + 3 =", "5"), ("7 * 6 =", "42"), ("10 - 4 =", "6"), ("9 + 9 =", "18"),
    ("12 / 3 =", "4"), ("5 * 5 =", "25"), ("8 - 8 =", "0"), ("3 + 14 =", "17"),
]


def build_prompt_batch(prompts: int, seq_len: int = 16) -> DataProto:
    """A prompt batch as a dataloader would produce it (tokens are byte values)."""
    texts = [PROMPTS[i % len(PROMPTS)][0] for i in range(prompts)]
    answers = [PROMPTS[i % len(PROMPTS)][1] for i in range(prompts)]
    ids = torch.zeros(prompts, seq_len, dtype=torch.int64)
    mask = torch.zeros(prompts, seq_len, dtype=torch.bool)
    for row, text in enumerate(texts):
        tokens = list(text.encode())[:seq_len]
        ids[row, seq_len - len(tokens):] = torch.tensor(tokens)  # left padding, as for generation
        mask[row, seq_len - len(tokens):] = True
    return DataProto.from_dict(
        tensors={"input_ids": ids, "attention_mask": mask},
        non_tensors={
            "uid": object_column([str(uuid.UUID(int=i)) for i in range(prompts)]),
            "raw_prompt": object_column(texts),
            "ground_truth": object_column(answers),
        },
        meta_info={"temperature": 1.0, "global_step": 0},
    )


def run_dataproto_demo(prompts: int = 6, n: int = 4, workers: int = 2) -> int:
    import ray

    run_dir = tempfile.mkdtemp(prefix="rlhf-demo-")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    t0 = time.perf_counter()
    ray.init(address="local", num_cpus=max(2, workers), include_dashboard=False,
             _temp_dir=os.path.join(run_dir, "ray"), log_to_driver=False,
             configure_logging=False)
    try:
        @ray.remote(num_cpus=0)
        class ScoreWorker:
            """Stands in for a rollout/reward worker: adds per-token log-probs and a score."""

            def compute(self, data: DataProto) -> DataProto:
                generator = torch.Generator().manual_seed(0)
                logp = -torch.rand(data.batch["input_ids"].shape, generator=generator)
                logp = logp * data.batch["attention_mask"]
                score = object_column([float(len(p)) / 10 for p in data.non_tensor_batch["raw_prompt"]])
                out = DataProto.from_dict({"old_log_probs": logp}, {"score": score},
                                          {"metrics": {"worker/rows": len(data)}})
                return out

        group = [ScoreWorker.remote() for _ in range(workers)]
        batch = build_prompt_batch(prompts)
        print(f"[demo] prompt batch:\n{batch.get_data_info()}")

        batch = batch.repeat(n, interleave=True)  # n responses per prompt share one uid
        batch.meta_info["_verl_auto_padding"] = True
        chunks = batch.chunk(workers)
        print(f"[demo] repeat(n={n}) -> {len(batch)} rows; chunk({workers}) -> "
              f"{[len(c) for c in chunks]} rows per worker")
        results = ray.get([w.compute.remote(c) for w, c in zip(group, chunks)])
        computed = DataProto.concat(results)
        batch.union(computed.select(batch_keys=["old_log_probs"], non_tensor_batch_keys=["score"]))
        print(f"[demo] after union:\n{batch.get_data_info()}")
        print(f"[demo] per-worker metrics merged by concat: {computed.meta_info['metrics']}")

        uids, first = np.unique(batch.non_tensor_batch["uid"], return_index=True)
        print(f"[demo] {len(uids)} uids, each on {len(batch) // len(uids)} rows; "
              f"group of uid {batch.non_tensor_batch['uid'][0][-4:]}: "
              f"{batch.non_tensor_batch['raw_prompt'][0]!r} -> "
              f"ground truth {batch.non_tensor_batch['ground_truth'][0]!r}")
        masked = batch.batch["old_log_probs"][~batch.batch["attention_mask"]]
        assert torch.all(masked == 0), "padding positions must carry zero log-prob"
        print(f"[demo] done in {time.perf_counter() - t0:.1f}s (Ray start included); "
              f"the PPO trainer replaces this demo in a later release")
    finally:
        ray.shutdown()
    return 0


# ---------------------------------------------------------------- the RLHF demo's annotator


def simulated_preferences(policy_path: str, count: int, seed: int, noise: float = 0.1,
                          temperature: float = 1.0, other_models: float = 0.5,
                          degenerate: float = 0.0) -> tuple[list[dict], dict]:
    """Preference pairs on the built-in task from a simulated annotator: for each of
    ``count`` prompts (their own draw, apart from the RL and warm-start prompts) two
    responses, each the policy's sample or, with probability ``other_models``, another
    model's (the right answer with 0-4 digits wrong, a third of them cut short or run on:
    as a preference set collected over
    several model versions has responses better than today's policy); the annotator
    prefers the one closer to the right answer (the task's score, which the reward model
    never sees), flips its choice with probability ``noise``, and passes on ties and empty
    responses. Returns the rows (``prompt``, ``chosen``, ``rejected``) and counts."""
    import random

    from transformers import AutoModelForCausalLM

    from rlhf_core.data.builtin import DATA_SOURCE, NUM_DIGITS, VOCAB, make_rows, reward_score

    model = AutoModelForCausalLM.from_pretrained(policy_path).eval()
    words = {v: k for k, v in VOCAB.items()}
    rows = make_rows(count, seed=seed + 500)
    generator = torch.Generator().manual_seed(seed + 500)
    ids = torch.tensor([[VOCAB["<bos>"]] + [VOCAB[c] for c in r["prompt"]] for r in rows for _ in range(2)])
    with torch.no_grad():
        for _ in range(NUM_DIGITS + 1):
            logits = model(ids).logits[:, -1] / temperature
            ids = torch.cat([ids, torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)], dim=1)
    prompt_length = NUM_DIGITS + 2
    texts = []
    for out in ids[:, prompt_length:].tolist():
        out = out[:out.index(VOCAB["<eos>"])] if VOCAB["<eos>"] in out else out
        texts.append("".join(words[t] for t in out if t >= VOCAB["="]))
    rng = random.Random(seed + 501)
    for i, row in enumerate(rows):  # some responses come from other models
        for side in (2 * i, 2 * i + 1):
            if rng.random() < other_models * degenerate:
                # what RL policies drift to: the prompt's digits copied, reordered or repeated
                digits = list(row["prompt"].rstrip("="))
                kind = rng.random()
                if kind < 1 / 3:
                    texts[side] = "".join(digits)
                elif kind < 2 / 3:
                    texts[side] = "".join(rng.sample(digits, len(digits)))
                else:
                    texts[side] = rng.choice(digits) * rng.randint(2, 2 * NUM_DIGITS - 1)
            elif rng.random() < other_models:
                answer = list(row["ground_truth"])
                for position in rng.sample(range(NUM_DIGITS), rng.randint(0, NUM_DIGITS)):
                    answer[position] = rng.choice("0123456789")
                if rng.random() < 1 / 3:  # and some of the wrong length, too short or too long
                    answer = answer[:rng.randint(1, NUM_DIGITS - 1)] if rng.random() < 0.5 else \
                        answer + [rng.choice("0123456789") for _ in range(rng.randint(1, NUM_DIGITS))]
                texts[side] = "".join(answer)
    pairs, ties, empty, flipped = [], 0, 0, 0
    for i, row in enumerate(rows):
        a, b = texts[2 * i], texts[2 * i + 1]
        if not a or not b:  # an empty response is no text to compare (the pair format refuses it)
            empty += 1
            continue
        score_a, score_b = (reward_score(DATA_SOURCE, t, row["ground_truth"])["score"] for t in (a, b))
        if score_a == score_b or a == b:
            ties += 1
            continue
        chosen, rejected = (a, b) if score_a > score_b else (b, a)
        if rng.random() < noise:
            chosen, rejected, flipped = rejected, chosen, flipped + 1
        pairs.append({"prompt": row["prompt"], "chosen": chosen, "rejected": rejected})
    return pairs, {"pairs": len(pairs), "ties_skipped": ties, "empty_skipped": empty, "flipped": flipped}


# ---------------------------------------------------------------- iterated RLHF: the rounds


def export_round_policy(store: str, run_id: str, folder) -> str:
    """The policy run ``run_id`` ended with (its last committed checkpoint) as a Hugging
    Face folder: the next round's starting point. Reused when ``folder`` holds a finished
    export; a half-written one (the process was killed) is written again."""
    import shutil

    from rlhf_core.export import export_checkpoint
    from rlhf_core.record.iteration_store import IterationStore
    from rlhf_core.record.run_layout import RunRef

    if (folder / "EXPORT.json").exists():  # written last
        return str(folder)
    istore = IterationStore(RunRef(store, run_id))
    committed = istore.committed_iterations()
    if not committed:
        raise SystemExit(f"rlhf: {istore.run_uri}: no committed iteration to start the next round from")
    checkpoint = istore.read_manifest(committed[-1])["checkpoint"]
    if not checkpoint:  # (a run whose last iteration wrote none: trainer.checkpoint_every without its end)
        raise SystemExit(f"rlhf: {istore.iteration_uri(committed[-1])}: wrote no checkpoint; the next round starts "
                         f"from a run's last checkpoint (its total a multiple of trainer.checkpoint_every)")
    shutil.rmtree(folder, ignore_errors=True)
    export_checkpoint(checkpoint, str(folder))
    return str(folder)


def rounds_history(store: str, base_id: str, rounds: int) -> list[dict]:
    """Every round's iterations in order, numbered across rounds (``iteration``) with their
    ``round``: the reward model's score and the task's own, as each run's manifests hold them."""
    from rlhf_core.record.iteration_store import IterationStore
    from rlhf_core.record.run_layout import RunRef
    from rlhf_core.trainer.report import run_history

    rows = []
    for r in range(rounds):
        for row in run_history(IterationStore(RunRef(store, f"{base_id}-round{r}"))):
            rows.append({**row, "round": r, "round_iteration": row["iteration"], "iteration": len(rows)})
    return rows


def write_rounds_curve(out, store: str, base_id: str, rounds: int):
    """``rounds.png`` in ``out``: the reward model's score (what PPO maximizes) and the
    task's hidden score over every round's iterations, a line where each round's reward
    model takes over; ``rounds.jsonl`` beside it with the points."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = rounds_history(store, base_id, rounds)
    (out / "rounds.jsonl").write_text("".join(json.dumps(
        {k: row.get(k) for k in ("iteration", "round", "round_iteration", "critic/score/mean",
                                 "critic/reward_extra/function_score/mean")}) + "\n" for row in rows))
    fig, task = plt.subplots(figsize=(7, 3.4))
    model = task.twinx()
    it = [row["iteration"] for row in rows]
    task.plot(it, [row.get("critic/reward_extra/function_score/mean", 0.0) for row in rows], color="tab:purple",
              label="task's score (never trained on)")
    model.plot(it, [row.get("critic/score/mean", 0.0) for row in rows], color="tab:blue", alpha=0.6,
               label="reward model's score (trained on)")
    for row in rows:
        if row["round_iteration"] == 0 and row["iteration"]:
            task.axvline(row["iteration"] - 0.5, color="grey", lw=0.8, ls="--")
    task.set_xlabel("PPO iteration (dashed: a new round's reward model)")
    task.set_ylabel("task's score")
    task.set_ylim(0, 1)
    model.set_ylabel("reward model's score")
    task.grid(alpha=0.3)
    lines = task.get_legend_handles_labels(), model.get_legend_handles_labels()
    task.legend(lines[0][0] + lines[1][0], lines[0][1] + lines[1][1], loc="lower right", fontsize=8)
    fig.tight_layout()
    path = out / "rounds.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
