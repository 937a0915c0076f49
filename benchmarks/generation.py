"""Rollout throughput: vLLM vs HF ``generate``, tokens per second, on this machine.

    .venv/bin/python benchmarks/generation.py [--skip-large]

Two models, each engine given the same prompts and sampling settings (seeded), timed
over repeated batches after an untimed warm-up:

1. the demo model (the built-in task's 2-layer Qwen2, 8-token responses, the default
   batch of 32 prompts x 8 responses): which engine the demo should use;
2. a ~100M-parameter Qwen2 built here with random weights (12 layers, hidden 768),
   GSM8K-style chat prompts, 128-token responses: where a real engine's batching and
   paged KV cache should pay off (goal: vLLM >= 3x HF).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: ~104M parameters: 12 x (attention 1.6M + MLP 7.1M) plus a small embedding.
SHAPE_100M = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
              "num_key_value_heads": 4, "tie_word_embeddings": True}


def prompts_for(model_dir: str, rows: list[dict], count: int, repeat: int, max_prompt_length: int):
    import torch

    from rlhf_core.data.dataset import PromptLoader
    from rlhf_core.data.tokenizer import PromptTokenizer

    loader = PromptLoader(rows, PromptTokenizer(model_dir), count, max_prompt_length, 0)
    batch = loader.next_batch().repeat(repeat)
    batch.batch["sample_seed"] = torch.arange(len(batch))
    return batch


def measure(model_dir: str, batch, response_length: int, max_model_len: int, repeats: int) -> dict:
    """tokens/s of each engine over ``repeats`` timed batches (after a warm-up batch)."""
    from rlhf_core.config import RunConfig
    from rlhf_core.workers import modeling
    from rlhf_core.rollout.engines.hf import HFEngine as HFRollout
    from rlhf_core.rollout.engines.vllm import VLLMEngine as VLLMRollout

    cfg = RunConfig().rollout
    cfg.response_length = response_length
    results = {}
    for name in ("vllm", "hf"):
        engine = (VLLMRollout(model_dir, cfg, seed=0, max_model_len=max_model_len) if name == "vllm" else
                  HFRollout(modeling.load_causal_lm(model_dir), modeling.load_tokenizer(model_dir), cfg, seed=0))
        engine.generate_batch(batch)  # warm-up (vLLM compiles and sizes its cache on first use)
        tokens, seconds = 0, 0.0
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = engine.generate_batch(batch)
            seconds += time.perf_counter() - t0
            tokens += int(out.batch["response_mask"].sum())
        results[name] = {"tokens_per_s": tokens / seconds, "tokens_per_batch": tokens / repeats,
                         "s_per_batch": seconds / repeats}
        del engine
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-large", action="store_true", help="only the demo model")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from rlhf_core.config import RunConfig
    from rlhf_core.models.builtin import builtin_model_path
    from rlhf_core.data.dataset import load_rows

    cfg = RunConfig()
    table = []
    demo = builtin_model_path(seed=0)
    print("[bench] demo model ...", flush=True)
    batch = prompts_for(demo, load_rows("builtin:digits"), cfg.data.train_batch_size, cfg.rollout.n,
                        cfg.data.max_prompt_length)
    table.append(("demo (2 layers, 0.4M)", len(batch), cfg.rollout.response_length,
                  measure(demo, batch, cfg.rollout.response_length, 64, args.repeats)))
    if not args.skip_large:
        from rlhf_core.testing.model_folders import build_model_folder, write_verl_parquet

        work = Path(tempfile.mkdtemp(prefix="rlhf-gen-"))
        print("[bench] building a ~100M-parameter model ...", flush=True)
        folder = build_model_folder(work / "qwen2-100m", SHAPE_100M)
        from rlhf_core.workers import modeling

        params = sum(p.numel() for p in modeling.load_causal_lm(str(folder)).parameters())
        rows = load_rows(str(write_verl_parquet(work / "gsm8k.parquet", 64)))
        batch = prompts_for(str(folder), rows, 16, 4, 128)
        print("[bench] 100M model ...", flush=True)
        table.append((f"Qwen2 {params / 1e6:.0f}M (12 layers)", len(batch), 128,
                      measure(str(folder), batch, 128, 512, args.repeats)))

    print("\nRollout throughput, tokens/s (2 CPU cores; same prompts, seeds and sampling settings)")
    print(f"{'model':<26}{'responses':>10}{'max len':>8}{'vLLM tok/s':>12}{'HF tok/s':>10}{'vLLM/HF':>9}")
    for name, rows_, length, r in table:
        print(f"{name:<26}{rows_:>10}{length:>8}{r['vllm']['tokens_per_s']:>12.0f}{r['hf']['tokens_per_s']:>10.0f}"
              f"{r['vllm']['tokens_per_s'] / r['hf']['tokens_per_s']:>8.2f}x")
    if len(table) > 1:
        r = table[1][3]
        print(f"goal on the ~100M model: vLLM/HF >= 3x: {r['vllm']['tokens_per_s'] / r['hf']['tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()
