"""GPU smoke check of the production path: FSDP2 + vLLM with sleep/wake on a 0.5B-class model.

    bash benchmarks/gpu_smoke.sh            # on a machine with 1+ NVIDIA GPUs

Builds a Qwen2.5-0.5B-shaped model here (random weights, tokenizer trained here; nothing
downloaded) and GSM8K-style verl parquet, places one rank per GPU (at most 2), and runs 2
GRPO iterations with FSDP, bf16 mixed precision and vLLM asleep while the actor trains.
Prints per iteration: rollout tokens/s, stage times, the weight-sync gather peak; per rank:
peak GPU memory of torch, and the device's used memory with the engine awake vs asleep.
Exits non-zero if anything fails. On a machine without a GPU it says so and exits 2.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_smoke: no CUDA device here; run it on a GPU machine", file=sys.stderr)
        return 2
    import ray

    from rlhf_core.config import RunConfig, apply_overrides
    from rlhf_core.testing.model_folders import QWEN2_0_5B, build_model_folder, write_verl_parquet
    from rlhf_core.trainer.ppo import PPOTrainer, TrainerState
    from rlhf_core.trainer.restore import make_loader
    from rlhf_core.workers.worker_set import WorkerSet

    gpus = min(2, torch.cuda.device_count())
    root = Path(tempfile.mkdtemp(prefix="rlhf-gpu-smoke-"))
    t0 = time.time()
    model = build_model_folder(root / "qwen2-0.5b-shape", QWEN2_0_5B)
    data = write_verl_parquet(root / "train.parquet", count=256)
    print(f"built the model folder and dataset in {time.time() - t0:.0f}s: {model}", flush=True)
    cfg = apply_overrides(RunConfig(), [
        f"model.path={model}", f"data.train_files={data}", "data.max_prompt_length=128", "data.train_batch_size=32",
        "rollout.n=8", "rollout.response_length=256", "actor.ppo_mini_batch_size=16",
        "actor.ppo_micro_batch_size_per_gpu=32", "actor.use_kl_loss=true", "actor.entropy_coeff=0.001",
        "actor.strategy=fsdp", f"actor.world_size={gpus}", f"resources.gpus_per_node={gpus}",
        "rollout.free_cache_engine=true", "rollout.gpu_memory_utilization=0.4", "reward.function=gsm8k",
        "model.enable_gradient_checkpointing=true", "trainer.progress=false"]).validate()
    ray.init(num_gpus=gpus, num_cpus=max(4, gpus * 2), include_dashboard=False)
    workers = WorkerSet.build(cfg)
    try:
        trainer = PPOTrainer(cfg, workers, make_loader(cfg, TrainerState()))
        for i in range(2):
            metrics = trainer.run_iteration()
            tokens = int(trainer.last_batch.batch["response_mask"].sum())
            print(json.dumps({"iteration": i, "response_tokens": tokens,
                              "rollout_tokens_per_s": tokens / metrics["timing_s/rollout"],
                              **{k: round(v, 3) for k, v in metrics.items()
                                 if k.startswith(("timing_s/", "perf/weight_sync", "actor/grad_norm", "critic/score"))}}),
                  flush=True)

        def memory(worker):
            actor = worker.roles["actor"]
            free, total = torch.cuda.mem_get_info()
            asleep_used = total - free
            actor.sync_weights()  # what the next rollout does: weights back, then the KV cache
            actor.rollout._wake_kv_cache()
            free, _ = torch.cuda.mem_get_info()
            awake_used = total - free
            actor.rollout._sleep()
            return {"rank": actor.rank, "torch_peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                    "device_used_asleep_gib": asleep_used / 2**30, "device_used_awake_gib": awake_used / 2**30,
                    "engine_sleeps": actor.rollout.sleeps}

        for row in ray.get([w.__ray_call__.remote(memory) for w in workers.group.workers]):
            print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    finally:
        workers.kill()
        ray.shutdown()
    print("gpu_smoke: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
