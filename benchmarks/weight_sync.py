"""The checkpoint engine's throughput against a plain copy of the same bytes.

    .venv/bin/python benchmarks/weight_sync.py [--repeats 3] [--megabytes 256] [--bucket-mb 64]

Two processes, one core each, as a trainer rank and a rollout replica on a pool of its own
(the CPU stand-in for two GPUs): the sender broadcasts a model's worth of fp32 tensors
(Qwen2-like shapes, `--megabytes` in all) through `rlhf_core.rollout.checkpoint_engine`
(gloo, buckets of `--bucket-mb`); the receiver copies each tensor into its own weights as
an engine's load does. Timed on the receiver, from asking for the weights to the last tensor
in place (the sender starts packing only when the receiver's clock runs). The baseline, in the same run and process: the same tensors copied into the same
destination weights (`Tensor.copy_`, a plain memory copy). Median of `--repeats`, spread
shown; written to docs/measured/weight_sync.json with the commit and the machine.

Goal (issue [1/7], CPU/gloo): the engine >= 0.5x the plain copy's bytes per second.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "benchmarks"))
from rollout_balance import commit, machine  # noqa: E402


def tensors(megabytes: int):
    import torch

    g = torch.Generator().manual_seed(0)
    out, total, i = [], 0, 0
    hidden = 1024
    while total < megabytes * 2**20:
        shape = (4 * hidden, hidden) if i % 3 == 0 else (hidden, hidden) if i % 3 == 1 else (hidden,)
        t = torch.randn(*shape, generator=g)
        out.append((f"layer.{i}", t))
        total += t.numel() * 4
        i += 1
    return out


def _rank(rank: int, port: int, megabytes: int, bucket_mb: int, repeats: int, out: str) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from rlhf_core.rollout import checkpoint_engine

    torch.set_num_threads(1)
    weights = tensors(megabytes)
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=120),
                              wait_for_workers=False)
        group = checkpoint_engine.WeightGroup("", 0, 0, 2, "gloo", store=store)
        for version in range(repeats + 1):
            store.wait([f"ready-{version}"])  # the receiver's clock is running: pack, send
            checkpoint_engine.send(group, iter(weights), bucket_mb * 2**20, version)
        return
    group = checkpoint_engine.WeightGroup("127.0.0.1", port, 1, 2, "gloo")
    held = {name: torch.empty_like(t) for name, t in weights}
    engine_s, copy_s = [], []
    for version in range(repeats + 1):  # the first is a warm-up
        t0 = time.perf_counter()  # the sender packs only once told: its packing is timed too
        group.store.set(f"ready-{version}", "1")
        for name, tensor in checkpoint_engine.receive(group):
            held[name].copy_(tensor)
        if version:
            engine_s.append(time.perf_counter() - t0)
        t1 = time.perf_counter()
        for name, tensor in weights:
            held[name].copy_(tensor)
        if version:
            copy_s.append(time.perf_counter() - t1)
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    Path(out).write_text(json.dumps({"bytes": nbytes, "engine_s": engine_s, "copy_s": copy_s}))


def main() -> None:
    import socket

    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--megabytes", type=int, default=256)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--out", default=str(ROOT / "docs" / "measured" / "weight_sync.json"))
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    raw = Path(args.out).with_suffix(".raw")
    mp.start_processes(_rank, args=(port, args.megabytes, args.bucket_mb, args.repeats, str(raw)), nprocs=2,
                       start_method="spawn")
    measured = json.loads(raw.read_text())
    raw.unlink()
    gib = measured["bytes"] / 2**30
    rate = {k: [gib / s for s in measured[f"{k}_s"]] for k in ("engine", "copy")}
    med = {k: statistics.median(v) for k, v in rate.items()}
    ratio = med["engine"] / med["copy"]
    for k in ("engine", "copy"):
        print(f"{k:6s} median {med[k]:6.2f} GiB/s (min-max {min(rate[k]):.2f}-{max(rate[k]):.2f}) over "
              f"{len(rate[k])} runs of {measured['bytes'] / 2**20:.0f} MiB")
    print(f"checkpoint engine / plain copy: {ratio:.2f}x (goal >= 0.5x: {'met' if ratio >= 0.5 else 'not met'})")
    result = {"benchmark": "benchmarks/weight_sync.py", "commit": commit(), "machine": machine(),
              "repeats": args.repeats, "bytes": measured["bytes"], "bucket_mb": args.bucket_mb,
              "gib_per_s": rate, "median_gib_per_s": med, "ratio_engine_over_copy": round(ratio, 3),
              "goal": ">= 0.5", "met": ratio >= 0.5, "backend": "gloo", "measured": time.strftime("%Y-%m-%d")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
