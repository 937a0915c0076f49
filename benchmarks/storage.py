"""What a run writes to its store per iteration: stage snapshots as deltas vs whole
batches, checkpoints, objects, and how long listing the run takes.

    .venv/bin/python benchmarks/storage.py [--iterations 20] [--store DIR]

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
from pathlib import Path


def _tree(path: Path) -> tuple[int, int]:
    files = [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files), len(files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--store", default=None, help="a local folder (default: a fresh temporary one)")
    args = parser.parse_args()

    from rlhf_core import audit
    from rlhf_core.config import RunConfig, apply_overrides
    from rlhf_core.ray_head import local_ray_env
    from rlhf_core.snapshot import list_snapshots, load_snapshot, save_snapshot
    from rlhf_core.trainer.run import run_direct

    local_ray_env()
    root = Path(args.store or tempfile.mkdtemp(prefix="rlhf-storage-"))
    cfg = apply_overrides(RunConfig(), ["trainer.progress=false", f"trainer.output_dir={root / 'out'}"]).validate()
    t0 = time.time()
    run_direct(cfg, args.iterations, f"file://{root}/store", "bench", log=lambda *a, **k: None)
    print(f"ran {args.iterations} direct iterations of the demo config in {time.time() - t0:.0f}s", flush=True)

    run = root / "store" / "bench"
    scratch = root / "whole"
    delta_bytes, delta_objects, whole_bytes, whole_objects, final_bytes = [], [], [], [], []
    for it in range(args.iterations):
        idir = run / f"iter-{it:06d}"
        stages = [i for i in list_snapshots(f"file://{idir}")]
        b, n = _tree(idir)
        delta_bytes.append(b)
        delta_objects.append(n)
        wb = wn = 0
        for info in stages:
            name = info.uri.rsplit("/", 1)[-1]
            whole = save_snapshot(load_snapshot(info.uri), f"file://{scratch}/iter-{it:06d}/{name}")
            b, n = _tree(scratch / f"iter-{it:06d}" / name)
            wb, wn = wb + b, wn + n
            last = (name, whole)
        whole_bytes.append(wb)
        whole_objects.append(wn)
        final_bytes.append(_tree(scratch / f"iter-{it:06d}" / last[0])[0])
    ckpt_bytes = [_tree(p)[0] for p in sorted((run / "checkpoints").iterdir())]
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


if __name__ == "__main__":
    sys.exit(main())
