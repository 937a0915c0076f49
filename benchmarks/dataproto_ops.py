"""Our DataProto side by side with verl 0.9.1's on the same batch.

    .venv/bin/python benchmarks/dataproto_ops.py [--repeats 7] [--batch 1024] [--seq 2048]

verl is never one of our dependencies. The first run creates a throwaway environment at
``.bench/verl-0.9.1`` that holds only ``verl==0.9.1`` (installed with ``--no-deps``) and
``omegaconf`` (the one extra module its protocol imports), and sees this project's
``.venv`` packages through a ``.pth`` file, so both implementations run on the very same
torch, tensordict, numpy and Ray builds. The script then re-runs itself inside that
environment and measures both in one process, alternating ours and verl's on every
repeat (the machine is shared and noisy), and prints median times and ours/verl ratios.

Batch: B rows, L tokens: int64 input_ids, three float32 log-prob tensors, a bool mask, and
``uid`` and ``prompt`` string columns. Ops: union (with overlapping equal keys, as
``batch.union(gen_output)`` does), chunk(8)+concat, repeat(4), select_idxs (half the rows,
shuffled), and a Ray round trip actor -> actor -> actor.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERL_VERSION = "0.9.1"
BENCH_ENV = ROOT / ".bench" / f"verl-{VERL_VERSION}"


def ensure_verl_env() -> Path:
    python = BENCH_ENV / "bin" / "python"
    marker = BENCH_ENV / ".ready"
    if marker.exists():
        return python
    print(f"[bench] creating throwaway environment {BENCH_ENV} with verl=={VERL_VERSION}", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(BENCH_ENV)], check=True)
    site = Path(subprocess.check_output(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip())
    (site / "rlhf_project_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    "--no-deps", f"verl=={VERL_VERSION}", "omegaconf", "antlr4-python3-runtime==4.9.3",
                    "PyYAML"], check=True)
    marker.write_text("ok\n")
    return python


# ------------------------------------------------------------------ the measured part


def build_inputs(batch: int, seq: int):
    import numpy as np
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32000, (batch, seq), generator=g)
    mask = torch.rand(batch, seq, generator=g) > 0.1
    logps = {f"log_probs_{i}": -torch.rand(batch, seq, generator=g) for i in range(3)}
    uid = np.array([f"{i:08x}-uid" for i in range(batch)], dtype=object)
    prompt = np.array([f"Question {i}: what is {i} + {i}? Think step by step." for i in range(batch)],
                      dtype=object)
    return ids, mask, logps, uid, prompt


def make_protos(cls, inputs):
    ids, mask, logps, uid, prompt = inputs
    left = cls.from_dict({"input_ids": ids, "attention_mask": mask},
                         {"uid": uid, "prompt": prompt}, {"temperature": 1.0})
    # The overlap is equal but not the same objects (as a worker's output would be), so
    # both implementations really compare the data.
    right = cls.from_dict({"input_ids": ids.clone(), **logps}, {"uid": uid.copy()},
                          {"temperature": 1.0})
    full = cls.from_dict({"input_ids": ids, "attention_mask": mask, **logps},
                         {"uid": uid, "prompt": prompt}, {"temperature": 1.0})
    return left, right, full


def shallow(cls, dp):
    from tensordict import TensorDict

    return cls(batch=TensorDict(dict(dp.batch.items()), batch_size=dp.batch.batch_size),
               non_tensor_batch=dict(dp.non_tensor_batch), meta_info=dict(dp.meta_info))


def run_inner(args) -> None:
    sys.path.insert(0, str(ROOT))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    import ray
    import torch
    from verl.protocol import DataProto as VerlDataProto

    from rlhf_core.protocol import DataProto as OurDataProto

    torch.set_num_threads(1)
    inputs = build_inputs(args.batch, args.seq)
    impls = {"ours": OurDataProto, "verl": VerlDataProto}
    protos = {name: make_protos(cls, inputs) for name, cls in impls.items()}
    idxs = torch.randperm(args.batch, generator=torch.Generator().manual_seed(1))[: args.batch // 2]

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             configure_logging=False, _temp_dir=str(ROOT / ".bench" / "ray"),
             object_store_memory=2 * 1024**3)

    @ray.remote(num_cpus=0)
    class Hop:
        def __init__(self, peer=None):
            self.peer = peer

        def forward(self, data):
            if self.peer is None:
                return data
            return ray.get(self.peer.forward.remote(data))

    def ray_roundtrip(full):
        # driver -> A (holding the batch) -> B -> A: one actor-to-actor hop each way.
        b = Hop.remote()
        a = Hop.remote(b)
        ray.get(a.forward.remote(None))
        ref = ray.put(full)

        def once():
            out = ray.get(a.forward.remote(ref))
            assert len(out) == len(full)
        return once

    def ops(name):
        cls = impls[name]
        left, right, full = protos[name]
        return {
            "union": lambda: shallow(cls, left).union(right),
            "chunk(8)+concat": lambda: cls.concat(full.chunk(8)),
            "repeat(4)": lambda: full.repeat(4, interleave=True),
            "select_idxs": lambda: full.select_idxs(idxs),
            "ray round trip": ray_roundtrip(full),
        }

    table = {name: ops(name) for name in impls}
    timings = {name: {op: [] for op in table[name]} for name in impls}
    for op in table["ours"]:
        for name in impls:  # warm up both
            table[name][op]()
        for r in range(args.repeats):
            order = list(impls) if r % 2 == 0 else list(reversed(impls))
            for name in order:
                t0 = time.perf_counter()
                table[name][op]()
                timings[name][op].append(time.perf_counter() - t0)
    ray.shutdown()

    mb = sum(t.numel() * t.element_size() for t in [inputs[0], inputs[1], *inputs[2].values()]) / 1e6
    print(f"\nDataProto ops, B={args.batch}, L={args.seq} ({mb:.0f} MB of tensors + 2 string columns), "
          f"median of {args.repeats}, torch threads=1")
    print(f"{'op':<18}{'ours ms':>10}{'verl ms':>10}{'ours/verl':>11}")
    worst = 0.0
    for op in timings["ours"]:
        ours = statistics.median(timings["ours"][op]) * 1e3
        theirs = statistics.median(timings["verl"][op]) * 1e3
        worst = max(worst, ours / theirs)
        print(f"{op:<18}{ours:>10.2f}{theirs:>10.2f}{ours / theirs:>10.2f}x")
    print(f"worst ratio: {worst:.2f}x (goal <= 1.00x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        run_inner(args)
        return
    python = ensure_verl_env()
    cmd = [str(python), __file__, "--inner", "--repeats", str(args.repeats),
           "--batch", str(args.batch), "--seq", str(args.seq)]
    sys.exit(subprocess.call(cmd))


if __name__ == "__main__":
    main()
