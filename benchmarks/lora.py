"""LoRA against a full fine-tune: checkpoint bytes per iteration, update tokens per second
and the actor worker's peak memory, as ratios measured in one run, and the arithmetic at 7B.

    .venv/bin/python benchmarks/lora.py [--repeats 2]

The actor worker itself (``ActorRolloutRefWorker``: ``init_model``, ``compute_log_prob``,
``compute_ref_log_prob``, ``update_actor``, ``start_checkpoint``/``finish_checkpoint``) runs
in-process on one rank, with a KL loss so that the reference policy is used: a full
fine-tune builds a frozen copy of the model for it, a LoRA run switches its adapter off.
Two models: the demo's built-in one, and a Qwen2 of 154M parameters built here with random
weights (hidden 1024, 8 layers, vocabulary 32,000). Each setting runs in a fresh process;
its memory is its peak RSS above what it held before ``init_model`` (weights, reference,
gradients, AdamW state, activations). Checkpoint bytes are the files one checkpoint
writes (``actor/``: DCP shards and metadata, the rank file).

Then the rollout engine (vLLM, in-process, the 154M model, 64 prompts of 64 tokens, 128
new tokens each): serving the policy's adapter as a LoRA request (verl's FSDP path, ours)
against serving merged weights (the adapter folded into the base, sent as a full
policy's are): seconds per weight sync and generated tokens per second, each engine in a
process of its own.

Goals (issue [4/7]): checkpoint bytes LoRA / full <= 0.1x on the demo model; the actor's
peak memory <= 0.6x on the demo model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: name -> (model shape or None for the built-in model, prompt tokens, response tokens, rows, LoRA rank)
MODELS = {
    "demo": (None, 16, 8, 256, 8),
    "154M": ({"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16,
              "num_key_value_heads": 4, "tie_word_embeddings": False, "vocab_size": 32000,
              "max_position_embeddings": 512}, 64, 128, 16, 32),
}
#: Qwen2.5-7B's shape, for the arithmetic.
QWEN2_5_7B = {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
              "num_key_value_heads": 4, "vocab_size": 152064}


def rollout_batch(rows: int, prompt: int, response: int, vocab: int, seed: int = 0):
    """Rows in the rollout's layout (full lengths) with every column the update reads."""
    import torch

    from rlhf_core.protocol import DataProto

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, prompt + response), generator=g)
    mask = torch.ones_like(ids)
    data = DataProto.from_dict({
        "prompts": ids[:, :prompt], "responses": ids[:, prompt:], "response_mask": mask[:, prompt:],
        "input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1),
        "old_log_probs": -torch.rand(rows, response, generator=g),
        "advantages": torch.randn(rows, response, generator=g)})
    data.meta_info["global_step"] = 1
    return data


def measure(folder: str, model: str, lora: bool, repeats: int) -> dict:
    """In this process: tokens/s of the update (best of ``repeats``), the peak RSS added
    from ``init_model`` on, and the bytes of one checkpoint."""
    import resource
    import time

    from rlhf_core.config import RunConfig, apply_overrides
    from rlhf_core.controller import Worker
    from rlhf_core.workers.actor import ActorRolloutRefWorker

    _, prompt, response, rows, rank = MODELS[model]
    Worker.init_process_group = lambda self, backend=None: backend  # one rank, no process group
    cfg = apply_overrides(RunConfig(), [
        f"model.path={folder}", f"data.max_prompt_length={prompt}", f"rollout.response_length={response}",
        "rollout.name=hf", "rollout.n=1", f"data.train_batch_size={rows}", f"actor.ppo_mini_batch_size={rows}",
        "actor.ppo_micro_batch_size_per_gpu=8", "actor.log_prob_micro_batch_size_per_gpu=8",
        "actor.ppo_epochs=1", "actor.use_kl_loss=true", "algorithm.use_kl_in_reward=false",
        "algorithm.adv_estimator=grpo", "algorithm.rollout_correction.bypass_mode=false",
        *([f"model.lora_rank={rank}", f"model.lora_alpha={2 * rank}"] if lora else [])])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    worker = ActorRolloutRefWorker(cfg)
    worker.init_model()
    data = rollout_batch(rows, prompt, response, worker.policy.config.vocab_size)
    data = data.union(worker.compute_ref_log_prob(data))
    tokens = int(data.batch["attention_mask"].sum())
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        worker.update_actor(data)
        seconds.append(time.perf_counter() - t0)
    with tempfile.TemporaryDirectory() as tmp:
        worker.start_checkpoint(f"file://{tmp}/ckpt")
        worker.finish_checkpoint()
        checkpoint = sum(f.stat().st_size for f in Path(tmp, "ckpt").rglob("*") if f.is_file())
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    trained = sum(p.numel() for p in worker.policy.parameters() if p.requires_grad)
    return {"tokens": tokens, "update_tps": tokens / min(seconds), "peak_mib": peak, "checkpoint_bytes": checkpoint,
            "trained_parameters": trained, "parameters": sum(p.numel() for p in worker.policy.parameters())}


def measure_engine(folder: str, served: str, repeats: int) -> dict:
    """In this process: a vLLM engine serving a trained rank-32 adapter of the 154M model,
    as a LoRA request (``served=adapter``) or merged into the weights (``merged``)."""
    import time

    import torch

    from rlhf_core.config import ModelConfig, RolloutConfig
    from rlhf_core.distributed import sharding
    from rlhf_core.protocol import DataProto
    from rlhf_core.workers import lora, modeling
    from rlhf_core.rollout.engines.vllm import VLLMEngine as VLLMRollout

    rank = MODELS["154M"][4]
    policy = lora.apply_lora(modeling.load_causal_lm(folder), ModelConfig(path=folder, lora_rank=rank,
                                                                           lora_alpha=2 * rank), folder)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if ".lora_B." in name:
                p.normal_(std=0.01)  # a trained adapter: not zero
    engine = VLLMRollout(folder, RolloutConfig(response_length=128, temperature=1.0), seed=0, max_model_len=256,
                         lora_rank=rank if served == "adapter" else 0)
    merged = policy.merge_and_unload() if served == "merged" else None

    def sync():
        if merged is None:
            engine.update_adapter(((lora.saved_name(n), t) for n, t in sharding.stream_full_parameters(
                policy, keep=lora.is_adapter)), lora.settings(policy))
        else:
            engine.update_weights(sharding.stream_full_parameters(merged))

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 32000, (64, 64), generator=g)
    prompts = DataProto.from_dict({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                   "sample_seed": torch.arange(64)})
    sync_s, tps = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sync()
        sync_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        out = engine.generate_batch(prompts)
        tps.append(int(out.batch["response_mask"].sum()) / (time.perf_counter() - t0))
    return {"sync_s": min(sync_s), "generate_tps": max(tps)}


def lora_parameters(shape: dict, rank: int) -> int:
    """Adapter parameters of ``all-linear`` at ``rank``: r x (in + out) per Linear of every layer."""
    h, i, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    linears = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]  # q k v o gate up down
    return layers * sum(rank * (a + b) for a, b in linears)


def base_parameters(shape: dict) -> int:
    h, i, layers, v = (shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"],
                       shape["vocab_size"])
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * i + 2 * h  # attention, MLP, two norms (biases left out)
    return layers * per_layer + 2 * v * h + h  # embeddings, untied head, final norm


def arithmetic_7b(rank: int = 64) -> list[str]:
    """What the measured ratios come to at Qwen2.5-7B (fp32 master weights and AdamW, as here)."""
    full, adapter = base_parameters(QWEN2_5_7B), lora_parameters(QWEN2_5_7B, rank)
    gib = 2 ** 30
    # checkpoint: weights + two AdamW moments of what trains (fp32)
    full_ckpt, lora_ckpt = 12 * full, 12 * adapter
    # state in memory: full = policy fp32 + grads fp32 + AdamW 2 x fp32 + reference (bf16 under mixed
    # precision); LoRA = the frozen base fp32 + the adapter's weights, grads and moments, no reference
    full_mem, lora_mem = (4 + 4 + 8 + 2) * full, 4 * full + 16 * adapter
    return [f"Qwen2.5-7B ({full / 1e9:.2f}B parameters), LoRA rank {rank} all-linear ({adapter / 1e6:.0f}M "
            f"parameters, {adapter / full:.2%}):",
            f"  checkpoint per iteration  full {full_ckpt / gib:6.1f} GiB   LoRA {lora_ckpt / gib:5.2f} GiB   "
            f"{lora_ckpt / full_ckpt:.3f}x",
            f"  model state in memory     full {full_mem / gib:6.1f} GiB   LoRA {lora_mem / gib:5.1f} GiB   "
            f"{lora_mem / full_mem:.2f}x (before activations; sharded over the ranks by FSDP2)"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--measure", nargs=3, metavar=("FOLDER", "MODEL", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--engine", nargs=2, metavar=("FOLDER", "SERVED"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        folder, model, mode = args.measure
        print(json.dumps(measure(folder, model, mode == "lora", args.repeats)))
        return
    if args.engine:
        print(json.dumps(measure_engine(*args.engine, args.repeats)))
        return
    from rlhf_core.testing.model_folders import build_model_folder

    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            shape = MODELS[model][0]
            folder = "builtin:digits" if shape is None else str(build_model_folder(Path(tmp) / model, shape))
            results = {}
            for mode in ("full", "lora"):
                out = subprocess.run([sys.executable, __file__, "--repeats", str(args.repeats),
                                      "--measure", folder, model, mode], capture_output=True, text=True, check=False)
                if out.returncode:
                    sys.exit(f"{model} {mode}: failed\n{out.stderr[-3000:]}")
                results[mode] = r = json.loads(out.stdout.strip().splitlines()[-1])
                print(f"{model:<5} {mode:<4} trains {r['trained_parameters']:>11,} of {r['parameters']:>11,}   "
                      f"update {r['update_tps']:8.0f} tok/s   peak +{r['peak_mib']:7.0f} MiB   "
                      f"checkpoint {r['checkpoint_bytes'] / 2**20:8.2f} MiB", flush=True)
            full, lora = results["full"], results["lora"]
            print(f"{model:<5} LoRA / full, measured in this run: checkpoint {lora['checkpoint_bytes'] / full['checkpoint_bytes']:.3f}x"
                  f"   update tokens/s {lora['update_tps'] / full['update_tps']:.2f}x"
                  f"   peak memory {lora['peak_mib'] / full['peak_mib']:.2f}x\n", flush=True)
            if model != "154M":
                continue
            served = {}
            for how in ("merged", "adapter"):
                out = subprocess.run([sys.executable, __file__, "--repeats", str(args.repeats), "--engine", folder, how],
                                     capture_output=True, text=True, check=False,
                                     env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
                if out.returncode:
                    sys.exit(f"engine {how}: failed\n{out.stderr[-3000:]}")
                served[how] = r = json.loads(out.stdout.strip().splitlines()[-1])
                print(f"vLLM serving {how:<8} weight sync {r['sync_s']:6.2f} s   generate {r['generate_tps']:7.0f} tok/s",
                      flush=True)
            a, m = served["adapter"], served["merged"]
            print(f"adapter request / merged weights, measured in this run: sync {a['sync_s'] / m['sync_s']:.2f}x   "
                  f"generate {a['generate_tps'] / m['generate_tps']:.2f}x\n", flush=True)
    print("\n".join(arithmetic_7b()))


if __name__ == "__main__":
    main()
