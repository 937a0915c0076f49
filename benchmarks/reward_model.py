"""The reward model: scoring throughput of the reward-model worker against a plain Hugging
Face forward of the same model, and training throughput, as ratios measured in one run.

    .venv/bin/python benchmarks/reward_model.py [--rows 64] [--repeats 3]

A Qwen2 sequence classifier built here with random weights (hidden 512, 4 layers,
vocabulary 8,192), rollout-shaped rows (prompts of 16-64 tokens left-padded to 64,
responses of 32-256 tokens right-padded to 256). Scoring, responses per second (best of
``--repeats``):

1. ``plain HF``: ``AutoModelForSequenceClassification(input_ids, attention_mask).logits``
   over the padded batch in micro-batches of 8 rows (what a script would write);
2. ``worker, 8 rows``: ``RewardModelWorker.compute_rm_score`` with
   ``micro_batch_size_per_gpu=8``;
3. ``worker, packed``: the same with ``use_dynamic_bsz`` (2,560 tokens) and
   ``model.use_remove_padding``.

Training, one epoch of pairs whose sides are these rows: tokens per second of the
forward, backward and AdamW step, ``rlhf reward-model train``'s loop (padding-free) against
a plain HF loop (the pooled logits of the padded pairs, the same loss).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

SHAPE = {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 2, "tie_word_embeddings": False, "vocab_size": 8192}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForSequenceClassification

    from packing import PROMPT, RESPONSE, rollout_batch
    from rlhf_core.config import RunConfig, apply_overrides
    from rlhf_core.controller import Worker
    from rlhf_core.testing.model_folders import build_model_folder, build_reward_model_folder
    from rlhf_core.workers.reward_model import RewardModelWorker

    torch.set_num_threads(2)
    Worker.init_process_group = lambda self, backend=None: backend  # one rank, no process group
    with tempfile.TemporaryDirectory() as tmp:
        policy = build_model_folder(Path(tmp) / "policy", {**SHAPE, "max_position_embeddings": 512})
        folder = build_reward_model_folder(Path(tmp) / "rm", policy, {**SHAPE, "max_position_embeddings": 512})
        data = rollout_batch(args.rows)
        tokens = int(data.batch["attention_mask"].sum())

        def best(fn) -> float:
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return min(times)

        plain = AutoModelForSequenceClassification.from_pretrained(folder).eval()

        def plain_hf():
            with torch.no_grad():
                for start in range(0, args.rows, 8):
                    plain(input_ids=data.batch["input_ids"][start:start + 8],
                          attention_mask=data.batch["attention_mask"][start:start + 8])

        settings = {"plain HF, 8 rows": plain_hf}
        for name, extra in (("worker, 8 rows", ["reward_model.micro_batch_size_per_gpu=8"]),
                            ("worker, packed", ["reward_model.use_dynamic_bsz=true",
                                                f"reward_model.forward_max_token_len_per_gpu={8 * (PROMPT + RESPONSE)}",
                                                "reward_model.model.use_remove_padding=true"])):
            cfg = apply_overrides(RunConfig(), [f"model.path={policy}", "reward_model.enable=true",
                                                f"reward_model.model.path={folder}", f"data.max_prompt_length={PROMPT}",
                                                f"rollout.response_length={RESPONSE}", *extra])
            worker = RewardModelWorker(cfg)
            worker.init_model()
            settings[name] = (lambda w: lambda: w.compute_rm_score(data))(worker)
        seconds = {name: best(fn) for name, fn in settings.items()}
        base = seconds["plain HF, 8 rows"]
        print(f"scoring {args.rows} responses ({tokens} real tokens of {args.rows * (PROMPT + RESPONSE)} padded):")
        for name, s in seconds.items():
            print(f"  {name:<18} {args.rows / s:8.1f} responses/s   {base / s:5.2f}x plain HF")

        from rlhf_core.trainer import preference

        ids, mask = data.batch["input_ids"], data.batch["attention_mask"]
        from rlhf_core.workers import packing

        model = preference.load_base(str(folder)).train()
        packing.enable_packing(model)  # the trainer's default (remove_padding)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        from rlhf_core.algorithms import bradley_terry_loss
        from rlhf_core.workers.reward_model import sequence_scores

        def train_epoch():
            for start in range(0, args.rows - 8, 8):  # pairs: rows i and i + 8 as chosen and rejected
                both = slice(start, start + 16)
                scores = sequence_scores(model, ids[both], mask[both], (mask[both].cumsum(1) - 1).clamp(min=0),
                                         packed=True)
                loss = bradley_terry_loss(scores[:8], scores[8:])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()

        hf_model = AutoModelForSequenceClassification.from_pretrained(folder).train()
        hf_optimizer = torch.optim.AdamW(hf_model.parameters(), lr=1e-5)

        def plain_hf_epoch():  # what a script would write: HF's pooled logits, the same loss
            for start in range(0, args.rows - 8, 8):
                both = slice(start, start + 16)
                scores = hf_model(input_ids=ids[both], attention_mask=mask[both]).logits[:, 0]
                loss = bradley_terry_loss(scores[:8], scores[8:])
                hf_optimizer.zero_grad(set_to_none=True)
                loss.backward()
                hf_optimizer.step()

        trained = int(sum(mask[start:start + 16].sum() for start in range(0, args.rows - 8, 8)))
        plain_s, ours_s = best(plain_hf_epoch), best(train_epoch)
        print(f"training (forward, backward, AdamW), {trained} real tokens an epoch:")
        print(f"  plain HF             {trained / plain_s:8.0f} tokens/s    1.00x")
        print(f"  rlhf reward-model    {trained / ours_s:8.0f} tokens/s    {plain_s / ours_s:5.2f}x plain HF")
        print(json.dumps({"scoring_responses_per_s": {k: args.rows / v for k, v in seconds.items()},
                          "training_tokens_per_s": {"plain HF": trained / plain_s, "ours": trained / ours_s}}))


if __name__ == "__main__":
    main()
