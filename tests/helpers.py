"""Helpers the test modules share (one module: tests import them from here, never from
each other; the package itself is imported as installed)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from rlhf_core.checkpoint.layout import TRAINER_STATE_FILE
from rlhf_core.config import RunConfig, apply_overrides
from rlhf_core.record.run_layout import RunRef


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


def names_nothing(uri: str) -> bool:
    """Whether ``uri`` (a checkpoint, a stage snapshot, an iteration) names nothing in its
    store: a checkpoint without its trainer state, a snapshot or an iteration without its
    commit marker."""
    import fsspec

    from rlhf_core.record import run_layout

    fs, path = fsspec.core.url_to_fs(uri.rstrip("/"))
    loc = run_layout.parse(uri.rstrip("/"))
    if loc is not None and loc.step is not None:
        return not fs.exists(f"{path}/{TRAINER_STATE_FILE}")
    if loc is not None and loc.iteration is not None and loc.stage is None:
        return not fs.exists(f"{path}/{run_layout.MANIFEST}")
    return not fs.exists(f"{path}/{run_layout.SNAPSHOT_MARKER}")


def uris_naming_nothing(store: str, run_id: str) -> list[str]:
    """Every URI the run's committed manifests and ``rlhf lineage`` name that names
    nothing (empty when each one is there)."""
    from rlhf_core.record.lineage import chain
    from rlhf_core.record.iteration_store import IterationStore

    istore = IterationStore(RunRef(store, run_id))
    named = []
    for n in istore.committed_iterations():
        manifest = istore.read_manifest(n)
        named += [u for u in (manifest["checkpoint"], manifest["weights"]["checkpoint"]) if u is not None]
        named += list(manifest["snapshots"].values())
    for row in chain(istore.run_uri):
        named += [row["checkpoint"], row["manifest"], *row["snapshots"].values()]
    return sorted({uri for uri in named if names_nothing(uri)})


# ----------------------------------------------------------- processes a test started

def in_session(proc, sid: int) -> bool:
    """Whether ``proc`` belongs to session ``sid`` (a command a test started with
    ``start_new_session=True``: its pid is the session's id)."""
    try:
        return os.getsid(proc.pid) == sid
    except OSError:
        return False


def status_of(proc) -> str | None:
    import psutil

    try:
        return proc.status()
    except psutil.Error:
        return None


def frozen_in_session(sid: int, leader, timeout_s: float = 600) -> list:
    """Wait until a process of session ``sid`` has stopped itself at its freeze point
    (``RLHF_FREEZE_AT``); return the session's processes then (``status_of`` tells the
    stopped ones). Fails if ``leader`` ends first."""
    import time

    import psutil

    deadline = time.monotonic() + timeout_s
    while leader.poll() is None and time.monotonic() < deadline:
        procs = [p for p in psutil.process_iter() if in_session(p, sid)]
        if any(status_of(p) == psutil.STATUS_STOPPED for p in procs):
            return procs
        time.sleep(0.2)
    raise AssertionError(f"no process of session {sid} reached its freeze point (leader exit code {leader.poll()})")


def still_alive(procs, timeout_s: float = 120) -> list:
    """The processes of ``procs`` still alive (zombies count as gone) after waiting for them."""
    import psutil

    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    return [p for p in alive if status_of(p) not in (None, psutil.STATUS_ZOMBIE)]

