"""Padding-free training: the update and log-prob stages, padded vs token budget vs token
budget + padding removal, tokens per second and peak memory, as ratios in one run.

    .venv/bin/python benchmarks/packing.py [--rows 64] [--repeats 3]

The actor worker's own stages (``compute_log_prob``, ``update_actor``: the forward, the
backward, the optimizer) run in-process on a Qwen2 built here with random weights
(hidden 512, 4 layers, vocabulary 8,192). A batch of rollout-shaped rows: prompts of 16-64
tokens left-padded to 64, responses of 32-256 tokens right-padded to 256 (an 8x spread),
each row's lengths drawn once from a seeded generator. Three settings, each in a fresh
process (its peak RSS above what it held before its first stage is its memory):

1. ``padded``: micro-batches of 8 rows (``ppo_micro_batch_size_per_gpu``,
   ``log_prob_micro_batch_size_per_gpu``);
2. ``token budget``: ``use_dynamic_bsz`` with budgets of 8 full rows' tokens (2,560), rows
   grouped and balanced by their real tokens;
3. ``token budget + packed``: the same with ``model.use_remove_padding``.

Tokens per second counts the rows' real tokens (prompt + response). Goal on this machine:
the update stage >= 1.5x ``padded`` with padding removal, memory no higher.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPE = {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 2, "tie_word_embeddings": False, "vocab_size": 8192,
         "max_position_embeddings": 512}
PROMPT, RESPONSE, MICRO = 64, 256, 8
SETTINGS = {
    "padded": [f"actor.ppo_micro_batch_size_per_gpu={MICRO}", f"actor.log_prob_micro_batch_size_per_gpu={MICRO}"],
    "token budget": ["actor.use_dynamic_bsz=true", f"actor.ppo_max_token_len_per_gpu={MICRO * (PROMPT + RESPONSE)}",
                     "actor.log_prob_use_dynamic_bsz=true",
                     f"actor.log_prob_max_token_len_per_gpu={MICRO * (PROMPT + RESPONSE)}"],
}
SETTINGS["token budget + packed"] = SETTINGS["token budget"] + ["model.use_remove_padding=true"]


def rollout_batch(rows: int, seed: int = 0):
    """Rows in the rollout's layout with spread lengths, and every column the update reads."""
    import torch

    from rlhf_core.protocol import DataProto

    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(16, PROMPT + 1, (rows,), generator=g)
    response_len = torch.randint(32, RESPONSE + 1, (rows,), generator=g)
    cols = torch.arange(PROMPT + RESPONSE)
    mask = ((cols >= PROMPT - prompt_len[:, None]) & (cols < PROMPT + response_len[:, None])).long()
    ids = torch.randint(3, SHAPE["vocab_size"], mask.shape, generator=g) * mask
    response_mask = mask[:, PROMPT:]
    log_probs = -torch.rand(rows, RESPONSE, generator=g) * response_mask
    data = DataProto.from_dict({
        "prompts": ids[:, :PROMPT], "responses": ids[:, PROMPT:], "response_mask": response_mask,
        "input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
        "old_log_probs": log_probs, "advantages": torch.randn(rows, RESPONSE, generator=g) * response_mask})
    data.meta_info["global_step"] = 1
    return data


def measure(folder: str, setting: str, rows: int, repeats: int) -> dict:
    """In this process: seconds of each stage (best of ``repeats``) and the peak RSS added."""
    import resource
    import time

    import torch

    from rlhf_core.config import RunConfig, apply_overrides
    from rlhf_core.controller import Worker
    from rlhf_core.workers.actor import ActorRolloutRefWorker

    Worker.init_process_group = lambda self, backend=None: backend  # one rank, no process group
    cfg = apply_overrides(RunConfig(), [f"model.path={folder}", f"data.max_prompt_length={PROMPT}",
                                        f"rollout.response_length={RESPONSE}", "rollout.name=hf", "rollout.n=1",
                                        f"data.train_batch_size={rows}", f"actor.ppo_mini_batch_size={rows}",
                                        "actor.ppo_epochs=2", "actor.entropy_coeff=0", "actor.use_kl_loss=false",
                                        "algorithm.use_kl_in_reward=false", "algorithm.adv_estimator=grpo",
                                        "algorithm.rollout_correction.bypass_mode=false", *SETTINGS[setting]])
    worker = ActorRolloutRefWorker(cfg)
    worker.init_model()
    data = rollout_batch(rows)
    tokens = int(data.batch["attention_mask"].sum())
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    seconds = {"log_prob": [], "update": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        with torch.no_grad():
            worker.compute_log_prob(data)
        seconds["log_prob"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        worker.update_actor(data)
        seconds["update"].append(time.perf_counter() - t0)
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    # the update runs ppo_epochs passes over the batch
    return {"tokens": tokens, "log_prob_tps": tokens / min(seconds["log_prob"]),
            "update_tps": 2 * tokens / min(seconds["update"]), "peak_mib": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--measure", nargs=2, metavar=("FOLDER", "SETTING"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(*args.measure, args.rows, args.repeats)))
        return
    from rlhf_core.testing.model_folders import build_model_folder

    with tempfile.TemporaryDirectory() as tmp:
        folder = str(build_model_folder(Path(tmp) / "model", SHAPE))
        results = {}
        for setting in SETTINGS:
            out = subprocess.run([sys.executable, __file__, "--rows", str(args.rows), "--repeats", str(args.repeats),
                                  "--measure", folder, setting], capture_output=True, text=True, check=False)
            if out.returncode:
                sys.exit(f"{setting}: failed\n{out.stderr[-3000:]}")
            results[setting] = json.loads(out.stdout.strip().splitlines()[-1])
            r = results[setting]
            print(f"{setting:<24} log-prob {r['log_prob_tps']:8.0f} tok/s   update {r['update_tps']:8.0f} tok/s   "
                  f"peak +{r['peak_mib']:7.0f} MiB", flush=True)
    base = results["padded"]
    print(f"\n{args.rows} rows, {base['tokens']} real tokens of {args.rows * (PROMPT + RESPONSE)} padded; "
          f"ratios against padded, measured in this run:")
    for setting, r in results.items():
        print(f"{setting:<24} log-prob {r['log_prob_tps'] / base['log_prob_tps']:5.2f}x   "
              f"update {r['update_tps'] / base['update_tps']:5.2f}x   memory {r['peak_mib'] / base['peak_mib']:5.2f}x")


if __name__ == "__main__":
    main()
