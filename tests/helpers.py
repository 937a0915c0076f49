"""Helpers the test modules share (one module: tests import them from here, never from
each other; the package itself is imported as installed)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from rlhf_core.config import RunConfig, apply_overrides


def small_config(out: Path) -> RunConfig:
    return apply_overrides(RunConfig(), ["data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "rollout.n=4",
                                         "trainer.progress=false", f"trainer.output_dir={out}"])


def fingerprint(store: Path, run_id: str) -> dict:
    """Checksums of everything that must be identical: snapshot objects, checkpoints."""
    root = store / run_id
    out = {}
    for manifest in sorted(root.glob("iter-*/*/SNAPSHOT.json")):
        rel = str(manifest.parent.relative_to(root))
        out[rel] = json.loads(manifest.read_text())["objects"]
    # the shards and every rank's schedule + RNG file (DCP's .metadata also records where
    # it was written, so it differs between two stores by design) of the checkpoints the
    # run's records name, by step (each write has its own prefix, a lost write is garbage)
    for folder in committed_checkpoints(root):
        step = folder.name.split("-")[1]
        for ckpt in sorted([*folder.glob("*/__*.distcp"), *folder.glob("*/rank-*.pt")]):
            out[f"checkpoints/step-{step}/{ckpt.relative_to(folder)}"] = hashlib.sha256(ckpt.read_bytes()).hexdigest()
    assert any(k.endswith(".distcp") for k in out), "the checkpoints hold shard files"
    return out


def committed_checkpoints(run: Path) -> list[Path]:
    """The checkpoint folders of a local run that its INITIAL.json and manifests name."""
    named = []
    initial = run / "checkpoints" / "INITIAL.json"
    if initial.exists():
        named.append(json.loads(initial.read_text())["checkpoint"])
    for manifest in sorted(run.glob("iter-*/MANIFEST.json")):
        body = json.loads(manifest.read_text())
        named.append((body.get("weights") or {}).get("checkpoint") or body["checkpoint"])
    return sorted({run / "checkpoints" / uri.rstrip("/").rsplit("/", 1)[-1] for uri in named})
