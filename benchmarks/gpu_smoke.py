"""GPU smoke check of the production path: FSDP2 + vLLM with sleep/wake on a 0.5B-class model.

    bash benchmarks/gpu_smoke.sh            # on a machine with 1+ NVIDIA GPUs (2 for TP=2)

Builds a Qwen2.5-0.5B-shaped model here (random weights, tokenizer trained here; nothing
downloaded) and GSM8K-style verl parquet, places one rank per GPU (at most 2): FSDP2 over
the ranks, one vLLM engine with tensor parallelism over them, asleep while the actor
trains. Steps, each ending in one ``PASS``/``FAIL`` line: build, workers, two GRPO
iterations (rollout, weight sync, update), a checkpoint, its reload (the log-probs of the
last batch equal before and after). Then per rank: torch's peak GPU memory and the
device's used memory with the engine awake and asleep. Exits non-zero if a step fails; on
a machine without a GPU it says so and exits 2.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling, wherever this runs from
from gpu_smoke_bare import Steps  # noqa: E402  (one PASS/FAIL line per step, shared)


def smoke_config(model: str, data: str, gpus: int):
    """The run the smoke check trains: what the GPU examples run, small (tested on CPU:
    tests/test_gpu_path.py checks it generates with vLLM over every GPU)."""
    from rlhf_core.config import RunConfig, apply_overrides

    return apply_overrides(RunConfig(), [
        f"model.path={model}", f"data.train_files={data}", "data.max_prompt_length=128", "data.train_batch_size=32",
        "rollout.name=vllm", f"rollout.tensor_model_parallel_size={gpus}", "rollout.n=8",
        "rollout.response_length=256", "rollout.free_cache_engine=true", "rollout.gpu_memory_utilization=0.4",
        "actor.ppo_mini_batch_size=16", "actor.ppo_micro_batch_size_per_gpu=32", "actor.use_kl_loss=true",
        "actor.entropy_coeff=0.001", "actor.strategy=fsdp", f"actor.world_size={gpus}",
        f"resources.gpus_per_node={gpus}", "reward.function=gsm8k", "model.enable_gradient_checkpointing=true",
        "trainer.progress=false"]).validate()


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_smoke: no CUDA device here; run it on a GPU machine", file=sys.stderr)
        return 2
    import ray

    from rlhf_core.testing.model_folders import QWEN2_0_5B, build_model_folder, write_verl_parquet
    from rlhf_core.testing.stage_store import LastBatch
    from rlhf_core.trainer.ppo import PPOTrainer, TrainerState
    from rlhf_core.trainer.restore import save_checkpoint
    from rlhf_core.trainer.loaders import make_loader
    from rlhf_core.workers.worker_set import WorkerSet

    gpus = min(2, torch.cuda.device_count())
    root = Path(tempfile.mkdtemp(prefix="rlhf-gpu-smoke-"))
    steps = Steps()
    built = steps.run("build a 0.5B-shaped Qwen2 and GSM8K-style data", lambda: (
        build_model_folder(root / "qwen2-0.5b-shape", QWEN2_0_5B), write_verl_parquet(root / "train.parquet", count=256)))
    if built is None:
        return 1
    cfg = smoke_config(str(built[0]), str(built[1]), gpus)
    ray.init(num_gpus=gpus, num_cpus=max(4, gpus * 2), include_dashboard=False)
    workers = steps.run(f"workers: FSDP2 over {gpus} rank(s), vLLM TP={gpus}", lambda: WorkerSet.build(cfg))
    try:
        trainer = (PPOTrainer(cfg, workers, make_loader(cfg, TrainerState()), stage_store=LastBatch())
                   if workers is not None else None)
        for i in range(2):
            def iteration():
                metrics = trainer.run_iteration()
                tokens = int(trainer.stage_store.batch.batch["response_mask"].sum())
                print(json.dumps({"iteration": i, "response_tokens": tokens,
                                  "rollout_tokens_per_s": tokens / metrics["timing_s/rollout"],
                                  **{k: round(v, 3) for k, v in metrics.items() if k.startswith(
                                      ("timing_s/", "perf/weight_sync", "actor/grad_norm", "critic/score"))}}),
                      flush=True)
            steps.run(f"iteration {i}: rollout (sleep/wake), weight sync, update", iteration)
        checkpoint = f"file://{root}/checkpoint"
        digests = steps.run("checkpoint (DCP, sharded)",
                            lambda: save_checkpoint(workers, trainer.state, cfg, checkpoint))

        def reload():
            before = workers["actor"].compute_log_prob(trainer.stage_store.batch).batch["old_log_probs"]
            workers.load_checkpoint(checkpoint, expected=digests)
            after = workers["actor"].compute_log_prob(trainer.stage_store.batch).batch["old_log_probs"]
            if not torch.equal(before, after):
                raise AssertionError(f"log-probs differ after the reload (max |diff| "
                                     f"{(before - after).abs().max().item():.3g})")
        steps.run("reload the checkpoint (same log-probs)", reload)

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

        rows = steps.run("memory per rank", lambda: ray.get(
            [w.__ray_call__.remote(memory) for w in workers.group.workers]))
        for row in rows or []:
            print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    finally:
        if workers is not None:
            workers.kill()
        ray.shutdown()
    print("gpu_smoke: " + ("FAIL" if steps.failed else "ok"))
    return 1 if steps.failed else 0


if __name__ == "__main__":
    sys.exit(main())
