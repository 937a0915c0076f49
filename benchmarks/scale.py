"""What each rank holds when a ~100M-parameter model trains with FSDP2 vs DDP, and what
weight sync gathers at once.

    .venv/bin/python benchmarks/scale.py [--worlds 1 2 4] [--steps 3] [--layers 12] [--hidden 768]

For each strategy and world size, real ranks (processes, gloo on CPU, the trainer's own
``rlhf_core.distributed.sharding``) build the model from a Qwen2 config (random weights, built
here), take AdamW steps, and count the bytes of parameters + gradients + optimizer state
they hold (local shards under FSDP). Printed as ratios against DDP in the same run:

- per-rank bytes, FSDP / DDP (goal: <= 1.2 / N)
- step time FSDP / DDP at N=2 (reported; gloo on 2 CPU cores, so communication is cheap
  and compute is shared: not a GPU prediction)
- weight sync: peak bytes of gathered tensors alive at once while streaming every
  parameter to a consumer that copies each into its own preallocated tensor (as vLLM's
  reload does), against one decoder layer's bytes (goal: <= 2 layers)
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import uuid

import torch
import torch.multiprocessing as mp


def build_model(layers: int, hidden: int):
    from rlhf_core.models.qwen2 import qwen2_from_config

    return qwen2_from_config(0, vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                             num_hidden_layers=layers, num_attention_heads=hidden // 64,
                             num_key_value_heads=hidden // 64, max_position_embeddings=512, tie_word_embeddings=True)


def _bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def _rank(rank: int, world: int, rdzv: str, strategy: str, args: dict, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="1",
                      RLHF_RDZV_ID=rdzv)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    from rlhf_core.controller.worker import Worker
    from rlhf_core.distributed import sharding
    from rlhf_core.workers import modeling

    model = build_model(args["layers"], args["hidden"])
    layer_bytes = _bytes(model.model.layers[0].parameters())
    largest = max(_bytes([t]) for t in model.state_dict().values())
    total_params = sum(p.numel() for p in model.parameters())
    model = modeling.init_distributed_model(Worker(), model, sharding.ShardingSpec(strategy=strategy))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 32000, (2, args["seq"]), generator=torch.Generator().manual_seed(rank))
    times = []
    for _ in range(args["steps"]):
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        sharding.grad_norm_and_clip(model, 1.0)
        optimizer.step()
        times.append(time.perf_counter() - t0)
    params = list(model.parameters())
    held = {"parameters": _bytes(params), "gradients": _bytes(p.grad for p in params if p.grad is not None),
            "optimizer": _bytes(v for s in optimizer.state.values() for k, v in s.items()
                                if torch.is_tensor(v) and k != "step")}
    # weight sync into an "engine" that owns its tensors (allocated before the sync starts)
    engine = {k: torch.empty_like(v.full_tensor() if hasattr(v, "full_tensor") else v)
              for k, v in sharding.unwrap(model).state_dict().items()}
    meter = sharding.GatherMeter()
    t0 = time.perf_counter()
    for name, tensor in sharding.stream_full_parameters(model, meter):
        engine[name].copy_(tensor)
        del tensor
    sync_s = time.perf_counter() - t0
    result = {"rank": rank, "held": held, "step_s": min(times[1:] or times), "sync_s": sync_s,
              "sync_peak": meter.peak, "gathered": meter.count, "layer_bytes": layer_bytes,
              "largest_tensor_bytes": largest, "total_params": total_params}
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)


def measure(strategy: str, world: int, args: dict) -> dict:
    out = os.path.join(tempfile.mkdtemp(prefix="rlhf-scale-"), "r")
    mp.start_processes(_rank, args=(world, uuid.uuid4().hex[:8], strategy, args, out), nprocs=world,
                       start_method="spawn")
    ranks = [json.load(open(f"{out}.{r}")) for r in range(world)]
    per_rank = max(sum(r["held"].values()) for r in ranks)
    return {"strategy": strategy, "world": world, "per_rank_bytes": per_rank, "ranks": ranks,
            "step_s": max(r["step_s"] for r in ranks), "sync_peak": max(r["sync_peak"] for r in ranks),
            "layer_bytes": ranks[0]["layer_bytes"], "largest_tensor_bytes": ranks[0]["largest_tensor_bytes"],
            "total_params": ranks[0]["total_params"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    opts = {"layers": args.layers, "hidden": args.hidden, "steps": args.steps, "seq": args.seq}
    results = []
    for world in args.worlds:
        for strategy in ("ddp", "fsdp"):
            t0 = time.time()
            results.append(measure(strategy, world, opts))
            print(f"  measured {strategy} N={world} in {time.time() - t0:.0f}s", flush=True)
    gib = 2 ** 30
    by = {(r["strategy"], r["world"]): r for r in results}
    first = results[0]
    print(f"\nmodel: {first['total_params'] / 1e6:.1f}M parameters, {args.layers} layers x hidden {args.hidden}; "
          f"one decoder layer = {first['layer_bytes'] / 2**20:.1f} MiB, the largest tensor (embeddings) = "
          f"{first['largest_tensor_bytes'] / 2**20:.1f} MiB = {first['largest_tensor_bytes'] / first['layer_bytes']:.2f} "
          f"layers (fp32)")
    print(f"\n{'N':>3} {'DDP GiB/rank':>13} {'FSDP GiB/rank':>14} {'FSDP/DDP':>9} {'goal <=1.2/N':>13} "
          f"{'sync peak (layers)':>19}")
    for world in args.worlds:
        ddp, fsdp = by[("ddp", world)], by[("fsdp", world)]
        ratio = fsdp["per_rank_bytes"] / ddp["per_rank_bytes"]
        sync_layers = fsdp["sync_peak"] / fsdp["layer_bytes"]
        print(f"{world:>3} {ddp['per_rank_bytes'] / gib:>13.3f} {fsdp['per_rank_bytes'] / gib:>14.3f} {ratio:>9.3f} "
              f"{'yes' if ratio <= 1.2 / world else 'NO':>6} ({1.2 / world:.3f}) {sync_layers:>12.2f}"
              f"{'' if world > 1 else ' (nothing gathered)'}")
    if 2 in args.worlds:
        ddp, fsdp = by[("ddp", 2)], by[("fsdp", 2)]
        print(f"\nstep time at N=2: FSDP {fsdp['step_s']:.3f}s / DDP {ddp['step_s']:.3f}s = "
              f"{fsdp['step_s'] / ddp['step_s']:.2f}x")
    sharded = [r for r in results if r["strategy"] == "fsdp" and r["world"] > 1]
    if sharded:
        worst = max(sharded, key=lambda r: r["sync_peak"])
        print(f"weight sync peak gathered: {worst['sync_peak'] / worst['layer_bytes']:.2f} layers' bytes = "
              f"{worst['sync_peak'] / worst['largest_tensor_bytes']:.2f}x the largest tensor = "
              f"{worst['sync_peak'] / (worst['total_params'] * 4):.3f} of the model (goal <= 2 layers; one tensor "
              f"is gathered at a time, so the embedding table sets the peak when it outweighs 2 layers)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
