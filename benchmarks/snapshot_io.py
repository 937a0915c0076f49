"""Snapshot store vs torch.save/torch.load of the same batch, to the same place.

    .venv/bin/python benchmarks/snapshot_io.py [--repeats 5] [--batch 1024] [--seq 2048]

Both sides write to local disk and to a SeaweedFS S3 bucket started on loopback for this
run. torch.save stands for what verl-style pipelines do (one pickle per batch); ours is a
committed, checksummed zarr snapshot. Reported per backend, medians over the repeats,
alternating the two sides every repeat:

* write, read (everything), one-field read, one-sample-by-uid read: ms and ours/torch
* stored bytes and the ratio
* what the read checks cost: the same three reads with every object checked against the
  manifest (size, sha256, chunk headers; what readers always do) and with those checks
  switched off in this process only, and the ratio

torch has no partial read, so its one-field and one-sample numbers are a full load.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlhf_core.protocol import DataProto, object_column  # noqa: E402
from rlhf_core.snapshot import fs as sfs  # noqa: E402
from rlhf_core.snapshot import load_snapshot, reader, save_snapshot  # noqa: E402
from rlhf_core.testing.s3server import LocalS3  # noqa: E402


obj = object_column  # one object per row (lists stay cells)


def build_batch(b: int, seq: int) -> DataProto:
    g = torch.Generator().manual_seed(0)
    return DataProto.from_dict(
        tensors={
            "input_ids": torch.randint(0, 32000, (b, seq), generator=g),
            "attention_mask": torch.rand(b, seq, generator=g) > 0.1,
            "old_log_probs": -torch.rand(b, seq, generator=g),
            "ref_log_prob": -torch.rand(b, seq, generator=g),
            "rollout_log_probs": -torch.rand(b, seq, generator=g),
            "values": torch.randn(b, seq, generator=g).to(torch.bfloat16),
        },
        non_tensors={
            "uid": obj([f"{uuid.UUID(int=i // 4)}" for i in range(b)]),
            "prompt": obj([f"Question {i}: what is {i} * 7? Show your work." for i in range(b)]),
            "response": obj([f"{i} * 7 = {i * 7}. The answer is {i * 7}." for i in range(b)]),
            "data_source": obj(["builtin/arith"] * b),
            "reward_extra_info": obj([{"acc": float(i % 2), "format": True} for i in range(b)]),
        },
        meta_info={"temperature": 1.0, "global_step": 7},
    )


def torch_payload(dp: DataProto) -> dict:
    return {"batch": dict(dp.batch.items()),
            "non_tensor_batch": {k: v.tolist() for k, v in dp.non_tensor_batch.items()},
            "meta_info": dp.meta_info}


def torch_write(dp: DataProto, loc: sfs.Location) -> int:
    buffer = io.BytesIO()
    torch.save(torch_payload(dp), buffer)
    data = buffer.getvalue()
    if loc.is_local:
        Path(loc.path).parent.mkdir(parents=True, exist_ok=True)
        with open(loc.path, "wb") as f:
            f.write(data)
    else:
        loc.fs.pipe_file(loc.path, data)
    return len(data)


def torch_read(loc: sfs.Location) -> dict:
    if loc.is_local:
        with open(loc.path, "rb") as f:
            data = f.read()
    else:
        data = loc.fs.cat_file(loc.path)
    return torch.load(io.BytesIO(data), weights_only=False)  # it is a pickle: that is the point


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


class unchecked:
    """Within the block, snapshot reads hand zarr the store's bytes without checking them
    against the manifest: the baseline that shows what the checks cost."""

    def __enter__(self):
        self.real = reader._verified_store
        reader._verified_store = lambda data_loc, manifest, uri, layouts: sfs.zarr_store(data_loc, read_only=True)

    def __exit__(self, *exc):
        reader._verified_store = self.real


def read_ops(uri: str, options: dict | None, uid: str) -> dict:
    out = {"read": timed(lambda: load_snapshot(uri, storage_options=options))[0],
           "one field": timed(lambda: load_snapshot(uri, fields=["old_log_probs"], storage_options=options))[0]}
    t, one = timed(lambda: load_snapshot(uri, uids=[uid], storage_options=options))
    assert len(one) == 4
    out["one sample by uid"] = t
    return out


def bench_backend(name: str, base: str, options: dict | None, dp: DataProto, repeats: int) -> list[tuple]:
    uid = dp.non_tensor_batch["uid"][len(dp) // 2]
    times = {k: {"ours": [], "torch": []} for k in ("write", "read", "one field", "one sample by uid")}
    checks = {k: {"checked": [], "unchecked": []} for k in ("read", "one field", "one sample by uid")}
    sizes = {}
    for r in range(repeats + 1):  # first round is a warm-up
        ours_uri = f"{base}/ours-{r}"
        torch_loc = sfs.resolve(f"{base}/torch-{r}.pt", options)
        sides = ["ours", "torch"] if r % 2 else ["torch", "ours"]
        results = {}
        for side in sides:
            if side == "ours":
                t, info = timed(lambda: save_snapshot(dp, ours_uri, storage_options=options))
                results[("write", side)], sizes[side] = t, info.stored_bytes
            else:
                t, size = timed(lambda: torch_write(dp, torch_loc))
                results[("write", side)], sizes[side] = t, size
        for side in sides:
            if side == "ours":
                for op, t in read_ops(ours_uri, options, uid).items():
                    results[(op, side)] = t
                with unchecked():
                    plain = read_ops(ours_uri, options, uid)
                if r:
                    for op, t in plain.items():
                        checks[op]["unchecked"].append(t)
                        checks[op]["checked"].append(results[(op, side)])
            else:
                full = timed(lambda: torch_read(torch_loc))[0]
                results[("read", side)] = full
                results[("one field", side)] = timed(lambda: torch_read(torch_loc)["batch"]["old_log_probs"])[0]
                results[("one sample by uid", side)] = timed(lambda: torch_read(torch_loc))[0]
        if r:
            for (op, side), t in results.items():
                times[op][side].append(t)
    rows = []
    for op, per in times.items():
        ours, theirs = statistics.median(per["ours"]) * 1e3, statistics.median(per["torch"]) * 1e3
        rows.append((name, op, ours, theirs))
    rows.append((name, "stored MB", sizes["ours"] / 1e6, sizes["torch"] / 1e6))
    check_rows = [(name, op, statistics.median(per["checked"]) * 1e3, statistics.median(per["unchecked"]) * 1e3)
                  for op, per in checks.items()]
    return rows, check_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=2048)
    args = parser.parse_args()
    dp = build_batch(args.batch, args.seq)
    rows, check_rows = [], []
    with tempfile.TemporaryDirectory(prefix="rlhf-bench-") as tmp:
        backend, checks = bench_backend("local disk", tmp, None, dp, args.repeats)
        rows, check_rows = rows + backend, check_rows + checks
    with LocalS3(bucket="bench") as s3:
        backend, checks = bench_backend("SeaweedFS S3", f"s3://{s3.bucket}/bench", s3.storage_options, dp,
                                        args.repeats)
        rows, check_rows = rows + backend, check_rows + checks

    print(f"\nSnapshot I/O, B={args.batch}, L={args.seq} (int64 ids, bool mask, 3x float32 "
          f"log-probs, bf16 values, 5 object columns), median of {args.repeats}")
    print(f"{'backend':<14}{'op':<20}{'ours':>10}{'torch':>10}{'ours/torch':>12}")
    for backend, op, ours, theirs in rows:
        print(f"{backend:<14}{op:<20}{ours:>10.1f}{theirs:>10.1f}{ours / theirs:>11.2f}x")
    print("\nWhat the read checks cost (every object against the manifest, chunk headers), ms")
    print(f"{'backend':<14}{'op':<20}{'checked':>10}{'unchecked':>10}{'ratio':>12}")
    for backend, op, checked, plain in check_rows:
        print(f"{backend:<14}{op:<20}{checked:>10.1f}{plain:>10.1f}{checked / plain:>11.2f}x")
    goals = {("SeaweedFS S3", "write"): 1.0, ("SeaweedFS S3", "read"): 1.0, ("local disk", "write"): 2.0}
    print("goals: " + ", ".join(
        f"{b} {op} <= {g:.1f}x: {'met' if next(o / t for bb, oo, o, t in rows if bb == b and oo == op) <= g else 'NOT met'}"
        for (b, op), g in goals.items()))
    one = next(o for b, op, o, _ in rows if b == "SeaweedFS S3" and op == "one sample by uid")
    print(f"one sample by uid on the local S3 server: {one:.1f} ms (goal < 50 ms: "
          f"{'met' if one < 50 else 'NOT met'})")


if __name__ == "__main__":
    main()
