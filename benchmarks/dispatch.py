"""Cost of one DP_COMPUTE_PROTO call vs the raw Ray floor.

    .venv/bin/python benchmarks/dispatch.py [--repeats 5] [--sizes 1 50 500]

For each size, a DataProto of that many MB (float32 rows of 4 KiB, see build()) goes
through ``wg.identity(batch)`` on 2 workers: chunk -> ray.put -> remote identity ->
ray.get -> concat. The floor does the same movement with no DataProto logic: ray.put of
two numpy halves, an identity actor method, ray.get of the results (no concat). A second
baseline adds the one concatenation that any caller who wants a single batch back pays.
All run in the same Ray session, alternating, and the ratios are printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlhf_core.controller import (  # noqa: E402
    Dispatch, RayClassWithInitArgs, RayResourcePool, RayWorkerGroup, Worker, register,
)
from rlhf_core.protocol import DataProto  # noqa: E402


class IdentityWorker(Worker):
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def identity(self, data: DataProto) -> DataProto:
        return data

    def raw_identity(self, array):
        return array


def build(mb: float) -> DataProto:
    row = 1024  # float32 values per row: 4 KiB
    rows = max(2, int(mb * 1024 * 1024 / (row * 4)))
    return DataProto.from_dict({"x": torch.randn(rows, row)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sizes", type=float, nargs="+", default=[1, 50, 500])
    args = parser.parse_args()

    import ray

    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "benchmarks"), str(ROOT),
                                                os.environ.get("PYTHONPATH", "")])
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             configure_logging=False, _temp_dir=tempfile.mkdtemp(prefix="rlhf-bench-ray-"),
             object_store_memory=int(max(args.sizes) * 8 * 1024 * 1024) + 512 * 1024 * 1024)
    pool = RayResourcePool([2], use_gpu=False, name_prefix="bench", cpus_per_process=1)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(IdentityWorker), name_prefix="identity")

    def ours(dp):
        out = wg.identity(dp)
        assert len(out) == len(dp)

    def floor(array, concat=False):
        halves = np.array_split(array, 2)
        refs = [ray.put(h) for h in halves]
        outs = ray.get([w.raw_identity.remote(r) for w, r in zip(wg.workers, refs)])
        assert sum(len(o) for o in outs) == len(array)
        if concat:  # what any caller needing one batch back must also pay
            np.concatenate(outs)

    rows = []
    for mb in args.sizes:
        dp = build(mb)
        array = dp.batch["x"].numpy()
        runs = {"ours": lambda: ours(dp), "floor": lambda: floor(array),
                "floor+concat": lambda: floor(array, concat=True)}
        for _ in range(5):  # warm up: first touches of object-store pages are slow
            for run in runs.values():
                run()
        times = {name: [] for name in runs}
        for r in range(args.repeats):
            order = list(runs) if r % 2 == 0 else list(reversed(runs))
            for name in order:
                t0 = time.perf_counter()
                runs[name]()
                times[name].append(time.perf_counter() - t0)
        rows.append((mb, *(statistics.median(times[n]) * 1e3 for n in runs)))
    wg.kill()
    ray.shutdown()

    print(f"\nDP_COMPUTE_PROTO identity on 2 workers vs raw ray.put/ray.get, median of {args.repeats}")
    print(f"{'size MB':>8}{'ours ms':>10}{'floor ms':>10}{'ratio':>8}{'floor+concat ms':>17}{'ratio':>8}")
    for mb, o, f, fc in rows:
        print(f"{mb:>8g}{o:>10.1f}{f:>10.1f}{o / f:>7.2f}x{fc:>17.1f}{o / fc:>7.2f}x")
    big = [o / f for mb, o, f, _ in rows if mb >= 50]
    if big:
        print(f"worst ratio to the raw floor at >= 50 MB: {max(big):.2f}x (goal <= 1.30x)")


if __name__ == "__main__":
    main()
