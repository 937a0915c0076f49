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
    # it was written, so it differs between two stores by design)
    for ckpt in sorted([*root.glob("checkpoints/step-*/*/__*.distcp"), *root.glob("checkpoints/step-*/*/rank-*.pt")]):
        out[str(ckpt.relative_to(root))] = hashlib.sha256(ckpt.read_bytes()).hexdigest()
    assert any(k.endswith(".distcp") for k in out), "the checkpoints hold shard files"
    return out
