"""What a run writes to its store per iteration: stage snapshots as deltas vs whole
batches, checkpoints, objects, and how long listing the run takes; and sharded
checkpoints vs torch.save.

    .venv/bin/python benchmarks/storage.py [--iterations 20] [--store DIR]
    .venv/bin/python benchmarks/storage.py checkpoints [--layers 4] [--hidden 512]

``checkpoints``: a model with AdamW state (FSDP at 2 ranks) saved and loaded with the
trainer's sharded checkpoint (every rank writes its shards, ``torch.distributed.checkpoint``)
vs ``torch.save`` / ``torch.load`` of the whole state gathered on rank 0, to the same place:
local disk and SeaweedFS (a real S3 server on loopback), at 1 and 2 ranks.

Runs the demo config in direct mode (a local Ray head, the built-in task), then measures
the run's store. The baseline is measured in the same run: every stage's composed batch
is written again as a whole snapshot (what each stage wrote before delta snapshots) to a
scratch store next to it. Printed:

- snapshot bytes written per iteration / bytes of the iteration's final batch written
  once (goal <= 1.3), deltas vs whole-batch snapshots;
- objects written per iteration (each one a request and a round trip on S3);
- checkpoint bytes per iteration (every iteration writes one today);
- ``rlhf snapshots ls`` of the run: seconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from rlhf_core.record.run_layout import RunRef
from pathlib import Path


def _tree(path: Path) -> tuple[int, int]:
    files = [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files), len(files)


def _ckpt_rank(rank: int, world: int, rdzv: str, target: str, options: dict | None, shape: dict, out: str) -> None:
    import io
    import json

    import torch

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="1",
                      RLHF_RDZV_ID=rdzv)
    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).parent))
    from scale import build_model

    from rlhf_core.controller.worker import Worker
    from rlhf_core.snapshot import fs as sfs
    from rlhf_core.distributed import sharding
    from rlhf_core.workers import modeling
    from rlhf_core.checkpoint.reader import load_sharded
    from rlhf_core.checkpoint.writer import finish_sharded, start_sharded

    model = modeling.init_distributed_model(Worker(), build_model(shape["layers"], shape["hidden"]),
                                            sharding.ShardingSpec(strategy="fsdp"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    ids = torch.randint(0, 32000, (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    tag = rdzv  # the same on every rank
    barrier = (lambda: torch.distributed.barrier()) if world > 1 else (lambda: None)
    result = {}
    barrier()
    t0 = time.perf_counter()
    written = finish_sharded(start_sharded(f"{target}/sharded-{tag}", "actor", model, optimizer, scheduler, options))
    barrier()
    result["sharded_save_s"] = time.perf_counter() - t0
    # loading checks every file against the digests the save recorded (as a resume does)
    expected = {k: v for part in sharding.all_gather_objects(written) for k, v in part.items()}
    t0 = time.perf_counter()
    load_sharded(f"{target}/sharded-{tag}", "actor", model, optimizer, scheduler, options, expected)
    barrier()
    result["sharded_load_s"] = time.perf_counter() - t0
    # the baseline: the whole state gathered on rank 0, one torch.save to the same place
    t0 = time.perf_counter()
    model_state, optim_state = sharding.full_state(model, optimizer)
    if rank == 0:
        buffer = io.BytesIO()
        torch.save({"model": model_state, "optim": optim_state}, buffer)
        result["bytes"] = buffer.tell()
        sfs.write_durably(f"{target}/whole-{tag}", {"state.pt": buffer.getvalue()}, options)
    barrier()
    result["torch_save_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    if rank == 0:
        raw = sfs.read_bytes(sfs.resolve(f"{target}/whole-{tag}/state.pt", options))
        torch.load(io.BytesIO(raw), weights_only=True)
    barrier()
    result["torch_load_s"] = time.perf_counter() - t0  # (unchecked; a broadcast to the other ranks not counted)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)


def checkpoints(argv: list[str]) -> None:
    import json
    import uuid

    import torch.multiprocessing as mp

    from rlhf_core.testing.s3server import LocalS3

    parser = argparse.ArgumentParser(prog="storage.py checkpoints")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    shape = {"layers": args.layers, "hidden": args.hidden}
    rows = []
    with LocalS3() as server:
        places = {"disk": (f"file://{tempfile.mkdtemp(prefix='rlhf-ckpt-bench-')}", None),
                  "SeaweedFS": (f"s3://{server.bucket}/ckpt-bench", server.storage_options)}
        for place, (target, options) in places.items():
            for world in (1, 2):
                runs = []
                for _ in range(args.repeats):
                    out = os.path.join(tempfile.mkdtemp(), "r.json")
                    mp.start_processes(_ckpt_rank, args=(world, uuid.uuid4().hex[:8], target, options, shape, out),
                                       nprocs=world, start_method="spawn")
                    runs.append(json.load(open(out)))
                best = {k: min(r[k] for r in runs) for k in runs[0]}
                rows.append((place, world, best))
                print(f"  measured {place} N={world}", flush=True)
    mib = rows[0][2]["bytes"] / 2**20
    print(f"\nstate: {mib:.1f} MiB (fp32 weights + AdamW), best of {args.repeats}")
    print(f"{'place':<10} {'N':>2} {'sharded save s':>15} {'torch.save s':>13} {'ratio':>6} "
          f"{'sharded load s':>15} {'torch.load s':>13} {'ratio':>6}")
    for place, world, r in rows:
        print(f"{place:<10} {world:>2} {r['sharded_save_s']:>15.3f} {r['torch_save_s']:>13.3f} "
              f"{r['sharded_save_s'] / r['torch_save_s']:>6.2f} {r['sharded_load_s']:>15.3f} "
              f"{r['torch_load_s']:>13.3f} {r['sharded_load_s'] / r['torch_load_s']:>6.2f}")


def main() -> None:
    if sys.argv[1:2] == ["checkpoints"]:
        return checkpoints(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--store", default=None, help="a local folder (default: a fresh temporary one)")
    args = parser.parse_args()

    from rlhf_core.record import audit, run_layout
    from rlhf_core.config import RunConfig, apply_overrides
    from rlhf_core.runtime.ray_head import local_ray_env
    from rlhf_core.snapshot import list_snapshots, load_snapshot, save_snapshot
    from rlhf_core.trainer.run import run_direct

    from rlhf_core.record import iteration_store
    from rlhf_core.record.checkpoints import weights_plan
    from rlhf_core.trainer.restore import open_run

    local_ray_env()
    root = Path(args.store or tempfile.mkdtemp(prefix="rlhf-storage-"))
    cfg = apply_overrides(RunConfig(), ["trainer.progress=false", f"trainer.output_dir={root / 'out'}"]).validate()
    store_uri = f"file://{root}/store"
    # per iteration: seconds spent writing stage snapshots, the controller's RSS, and how
    # long finding where the run stands takes (what a resuming controller does first)
    writes: dict[int, float] = {}
    real_save = iteration_store.IterationStore.save

    def timed_save(self, iteration, stage, batch):
        t = time.perf_counter()
        real_save(self, iteration, stage, batch)
        writes[iteration] = writes.get(iteration, 0.0) + time.perf_counter() - t

    iteration_store.IterationStore.save = timed_save
    probes: dict[int, dict] = {}

    def probe(step: int, stage: str) -> None:
        if stage == "rollout" and step in (10, args.iterations - 1):
            t = time.perf_counter()
            istore = iteration_store.IterationStore(RunRef(store_uri, "bench"))
            state = open_run(cfg, istore, log=lambda *a: None)
            weights_plan(istore, state.global_step)
            probes[step] = {"lookup_s": time.perf_counter() - t,
                            "rss_mib": int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20}

    t0 = time.time()
    run_direct(cfg, args.iterations, RunRef(store_uri, "bench"), log=lambda *a, **k: None, on_stage=probe)
    print(f"ran {args.iterations} direct iterations of the demo config in {time.time() - t0:.0f}s", flush=True)

    run = root / "store" / "bench"
    scratch = root / "whole"
    delta_bytes, delta_objects, whole_bytes, whole_objects, final_bytes = [], [], [], [], []
    for it in range(args.iterations):
        idir = run / run_layout.iteration_dir(it)
        stages = [i for i in list_snapshots(f"file://{idir}")]
        b, n = _tree(idir)
        delta_bytes.append(b)
        delta_objects.append(n)
        wb = wn = 0
        for info in stages:
            name = info.uri.rsplit("/", 1)[-1]
            whole = save_snapshot(load_snapshot(info.uri), f"file://{scratch}/{run_layout.iteration_dir(it)}/{name}")
            b, n = _tree(scratch / run_layout.iteration_dir(it) / name)
            wb, wn = wb + b, wn + n
            last = (name, whole)
        whole_bytes.append(wb)
        whole_objects.append(wn)
        final_bytes.append(_tree(scratch / run_layout.iteration_dir(it) / last[0])[0])
    ckpt_bytes = [_tree(p)[0] for p in sorted((run / run_layout.CHECKPOINTS).iterdir())]
    t0 = time.perf_counter()
    audit.list_store(f"file://{run}")
    listing_s = time.perf_counter() - t0

    mean = statistics.mean
    final = mean(final_bytes)
    print(f"\nper iteration (mean of {args.iterations}); the final batch written once = {final / 1024:.1f} KiB")
    print(f"{'':34} {'whole batches (before)':>24} {'deltas (now)':>14} {'now/before':>11}")
    print(f"{'snapshot bytes / final batch':34} {mean(whole_bytes) / final:>24.2f} {mean(delta_bytes) / final:>14.2f} "
          f"{mean(delta_bytes) / mean(whole_bytes):>11.2f}   goal <= 1.3: "
          f"{'yes' if mean(delta_bytes) / final <= 1.3 else 'NO'}")
    print(f"{'snapshot KiB written':34} {mean(whole_bytes) / 1024:>24.1f} {mean(delta_bytes) / 1024:>14.1f}")
    print(f"{'objects written':34} {mean(whole_objects):>24.1f} {mean(delta_objects):>14.1f} "
          f"{mean(delta_objects) / mean(whole_objects):>11.2f}")
    print(f"checkpoint bytes per iteration: {mean(ckpt_bytes) / 1024:.1f} KiB "
          f"({mean(ckpt_bytes) / mean(delta_bytes):.1f}x the snapshots; one checkpoint per iteration)")
    print(f"rlhf snapshots ls of the run ({args.iterations} iterations): {listing_s:.2f}s")
    last = args.iterations - 1
    if 10 in probes and last in probes and last > 10:
        early = statistics.mean(writes[i] for i in range(5, 15))
        late = statistics.mean(writes[i] for i in range(last - 9, last + 1))
        print(f"\n{'':36} {'iteration ~10':>14} {f'iteration ~{last}':>16} {'ratio':>7}   goal: flat within 10%")
        for name, a, b in (("snapshot write s / iteration", early, late),
                           ("resume lookup s (open_run)", probes[10]["lookup_s"], probes[last]["lookup_s"]),
                           ("controller RSS MiB", probes[10]["rss_mib"], probes[last]["rss_mib"])):
            print(f"{name:36} {a:>14.3f} {b:>16.3f} {b / a:>7.2f}")


if __name__ == "__main__":
    sys.exit(main())
