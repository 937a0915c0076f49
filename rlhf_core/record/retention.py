"""What a run keeps in its store, and ``rlhf gc``: remove what the retention policy lets go,
orphaned writer prefixes and dead leases, never what a kept iteration needs.

The policy (``trainer.keep_checkpoints`` / ``keep_checkpoints_every`` and
``trainer.keep_snapshots`` / ``keep_snapshots_every``; 0 keeps everything) applies only to
committed iterations with no live lease:

- checkpoints: the last K, every M-th step, and always the one the newest weights start
  from (with ``trainer.checkpoint_every`` > 1, the last checkpoint plus a redo);
- stage snapshots: every stage of the last N committed iterations and of every M-th one,
  and of every iteration that redo needs; an iteration's stages go together (a delta's
  chain stays whole);
- manifests are always kept, so lineage, metrics and config of every iteration remain.

Garbage regardless of the policy, once older than the grace period: ``data-*`` prefixes
and checkpoint folders no manifest names (a writer that crashed or lost a race), lease
logs of committed iterations, writers' scratch files (``.tmp-*``) and incomplete multipart
uploads under the run. Nothing under an uncommitted iteration is touched while its lease
is live, nor the checkpoint such an iteration may be writing.

Ages are the store's: object times (mtime on disk, LastModified on S3) against the
store's present time (the ``Date`` of an S3 answer; on disk the time of a scratch file
made for it), so the clock of the machine running gc does not matter. The grace period
cannot go below ``MIN_GRACE_S``: what is younger may be a write still under way.
"""

from __future__ import annotations

import errno
import os
import time
from dataclasses import dataclass, field

from rlhf_core.checkpoint.layout import TRAINER_STATE_FILE
from rlhf_core.record import run_layout
from rlhf_core.snapshot import fs as sfs
from rlhf_core.snapshot.layout import DATA_PREFIX, MANIFEST_NAME, TMP_PREFIX
from rlhf_core.record.lease import CONTROLLER_TTL_S

#: The shortest grace period gc accepts (seconds). A writer's newest object is at most
#: one object's write old while it writes (a checkpoint shard of a large model on a slow
#: store: minutes); anything younger than this may be such a write.
MIN_GRACE_S = 600.0


@dataclass(frozen=True)
class RetentionPolicy:
    keep_checkpoints: int = 0        # the last K checkpoints (0: all)
    keep_checkpoints_every: int = 0  # and every M-th step (0: none besides the last K)
    keep_snapshots: int = 0          # stage snapshots of the last N committed iterations (0: all)
    keep_snapshots_every: int = 0    # and of every M-th iteration

    @classmethod
    def from_config(cls, cfg) -> "RetentionPolicy":
        t = cfg.trainer
        return cls(t.keep_checkpoints, t.keep_checkpoints_every, t.keep_snapshots, t.keep_snapshots_every)

    def kept_checkpoints(self, steps: list[int]) -> set[int]:
        """Of the checkpoints at ``steps``: the last K, every M-th, and the newest."""
        steps = sorted(steps)
        if not self.keep_checkpoints:
            return set(steps)
        every = {s for s in steps if self.keep_checkpoints_every and s % self.keep_checkpoints_every == 0}
        return set(steps[-self.keep_checkpoints:]) | every

    def keeps_snapshots(self, iteration: int, newest: int) -> bool:
        if not self.keep_snapshots:
            return True
        return iteration > newest - self.keep_snapshots or bool(self.keep_snapshots_every and
                                                                iteration % self.keep_snapshots_every == 0)


@dataclass
class GcPlan:
    """What ``collect`` removes (or, dry, would remove), by kind, as URIs."""

    checkpoints: list[str] = field(default_factory=list)
    snapshots: list[str] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    leases: list[str] = field(default_factory=list)
    scratch: list[str] = field(default_factory=list)   # writers' .tmp-* files left behind
    uploads: list[tuple[str, str]] = field(default_factory=list)  # incomplete multipart: (key URI, upload id)
    bytes: int = 0

    def all(self) -> list[str]:
        """What is removed by deleting it (``uploads`` are aborted instead)."""
        return self.checkpoints + self.snapshots + self.orphans + self.leases + self.scratch


def _age_s(loc: sfs.Location, now: float) -> float:
    """Seconds since the newest object under ``loc`` was written (0 when unknown)."""
    newest = 0.0
    try:
        infos = loc.fs.find(loc.path, detail=True) if loc.fs.isdir(loc.path) else {loc.path: loc.fs.info(loc.path)}
    except FileNotFoundError:
        return 0.0
    for info in infos.values():
        newest = max(newest, sfs.stamp(info))
    return now - newest if newest else 0.0


def _size(loc: sfs.Location) -> int:
    try:
        return int(loc.fs.du(loc.path, total=True))
    except FileNotFoundError:
        return 0


def _children(loc: sfs.Location) -> list[str]:
    """Names under ``loc`` that hold at least one object (a filer-backed S3 such as
    SeaweedFS keeps an empty folder entry after its objects are deleted: that is gone)."""
    try:
        entries = loc.fs.ls(loc.path, detail=True)
    except FileNotFoundError:
        return []
    names = []
    for entry in entries:
        path = entry["name"].rstrip("/")
        if entry.get("type") == "directory" and not any(
                info.get("type") != "directory" for info in loc.fs.find(path, detail=True).values()):
            continue
        names.append(path.rsplit("/", 1)[-1])
    return sorted(names)


def check_grace(grace_s: float) -> float:
    if not grace_s >= MIN_GRACE_S:
        raise ValueError(f"grace_s: expected at least {MIN_GRACE_S:g} seconds (anything younger may be a write "
                         f"still under way); found {grace_s:g}")
    return grace_s


def plan_gc(run_uri: str, policy: RetentionPolicy, grace_s: float = 3600.0,
            storage_options: dict | None = None, now: float | None = None,
            lease_ttl_s: float = CONTROLLER_TTL_S) -> GcPlan:
    """What may go from the run at ``run_uri`` (nothing is removed here). An uncommitted
    iteration whose lease is live (``lease_ttl_s``: the controllers' TTL) is left alone
    entirely, and so is a checkpoint it may be writing. ``now``: the store's present
    time (default: asked of the store, ``store_now``); ``grace_s`` >= ``MIN_GRACE_S``."""
    from rlhf_core.record.iteration_store import IterationStore
    from rlhf_core.record.lease import LeaseLog
    from rlhf_core.record.checkpoints import named_checkpoints, newest_weights, writer_iteration

    check_grace(grace_s)
    run = sfs.resolve(run_uri, storage_options)
    if hasattr(run.fs, "invalidate_cache"):
        run.fs.invalidate_cache()
    now = sfs.store_now(run) if now is None else now
    istore = IterationStore(run_layout.RunRef.from_uri(run.uri), storage_options)
    committed = istore.committed_iterations()
    committed_set = set(committed)
    plan = GcPlan()
    newest = committed[-1] if committed else -1

    def writing(iteration: int) -> bool:
        """Whether a controller holds the uncommitted ``iteration``: it may be writing now."""
        if iteration in committed_set:
            return False
        log = LeaseLog(istore.run, iteration, ttl_s=lease_ttl_s)
        latest = log.latest()
        return latest is not None and not log.is_free(latest[1], holder="rlhf-gc")

    def lease_released(iteration: int) -> bool:
        """Whether the committed ``iteration``'s lease is released or its holder gone: a
        holder commits, then releases, and its log must be there for the release."""
        log = LeaseLog(istore.run, iteration, ttl_s=lease_ttl_s)
        latest = log.latest()
        return latest is None or log.is_free(latest[1], holder="rlhf-gc")

    # what the newest weights are made of: a checkpoint and the iterations redone after it
    run_format = istore.run_format()
    named = named_checkpoints(istore, committed, run_format)
    needed, redo = newest_weights(istore, committed, run_format, named)
    kept = policy.kept_checkpoints(sorted(set(named.values())))
    for name in _children(run.child(run_layout.CHECKPOINTS)):
        step = run_layout.step_of_checkpoint_dir(name)
        if step is None:
            continue
        loc = run.child(run_layout.CHECKPOINTS, name)
        if name in named:  # committed: the policy decides, the newest weights' stays
            if step not in kept and loc.uri != (needed or "").rstrip("/"):
                plan.checkpoints.append(loc.uri)
        # named by nothing: a writer that crashed or lost a race, unless the iteration
        # that writes it (step S: iteration S - 1; the initial one: iteration 0) is live,
        # or committed it since ``named`` was read: a writer commits before it releases
        # its lease, so a record read after the lease read shows such a commit
        elif not writing(max(writer_iteration(step, run_format), 0)) and _age_s(loc, now) >= grace_s \
                and name not in named_checkpoints(istore, istore.committed_iterations(), run_format):
            plan.orphans.append(loc.uri)
    for name in _children(run):
        iteration = run_layout.iteration_of_dir(name)
        if iteration is None:
            continue
        it_loc = run.child(name)
        if writing(iteration):
            continue  # a controller holds it: it may be writing right now
        drop_stages = (iteration in committed_set and not policy.keeps_snapshots(iteration, newest)
                       and iteration not in redo)  # a redo needs its iteration's stage inputs
        for stage in _children(it_loc):
            if stage == run_layout.MANIFEST or stage.startswith(TMP_PREFIX):
                continue
            stage_loc = it_loc.child(stage)
            if drop_stages:
                plan.snapshots.append(stage_loc.uri)
                continue
            plan.orphans += _orphans(stage_loc, grace_s, now)
    for name in _children(run.child(run_layout.LEASES)):
        iteration = run_layout.iteration_of_dir(name)
        lease_loc = run.child(run_layout.LEASES, name)
        if iteration in committed_set and _age_s(lease_loc, now) >= grace_s and lease_released(iteration):
            plan.leases.append(lease_loc.uri)
    plan.scratch = _stale_scratch(run, grace_s, now)
    plan.uploads = _stale_uploads(run, grace_s, now)
    plan.bytes = sum(_size(sfs.resolve(uri, storage_options)) for uri in plan.all())
    return plan


def _stale_scratch(run: sfs.Location, grace_s: float, now: float) -> list[str]:
    """Writers' ``.tmp-*`` objects under the run (a create-only write's temp file, a
    create-only probe) older than the grace period: their writer died before removing them."""
    try:
        found = run.fs.find(run.path, detail=True)
    except FileNotFoundError:
        return []
    return sorted(run.child(path[len(run.path):]).uri for path, info in found.items()
                  if path.rsplit("/", 1)[-1].startswith(TMP_PREFIX) and now - sfs.stamp(info) >= grace_s)


def _stale_uploads(run: sfs.Location, grace_s: float, now: float) -> list[tuple[str, str]]:
    """Multipart uploads under the run that were begun longer than the grace period ago
    and never completed (a writer killed mid-file): the store keeps their parts, unseen
    and billed, until they are aborted."""
    if run.protocol != "s3":
        return []
    bucket, _, prefix = run.path.partition("/")
    out, markers = [], {}
    while True:
        answer = run.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix.rstrip("/") + "/", **markers)
        for upload in answer.get("Uploads") or []:
            if now - sfs.stamp(upload) >= grace_s:
                out.append((f"s3://{bucket}/{upload['Key']}", upload["UploadId"]))
        if not answer.get("IsTruncated"):
            return sorted(out)
        markers = {"KeyMarker": answer.get("NextKeyMarker", ""), "UploadIdMarker": answer.get("NextUploadIdMarker", "")}


def _orphans(stage_loc: sfs.Location, grace_s: float, now: float) -> list[str]:
    """``data-*`` prefixes of a snapshot folder that its manifest does not name (all of
    them when it has none), older than the grace period."""
    import json

    raw = sfs.read_bytes(stage_loc.child(MANIFEST_NAME))
    named = json.loads(raw).get("data_prefix") if raw is not None else None
    out = []
    for child in _children(stage_loc):
        if child.startswith(DATA_PREFIX) and child != named and _age_s(stage_loc.child(child), now) >= grace_s:
            out.append(stage_loc.child(child).uri)
    return out


def collect(run_uri: str, policy: RetentionPolicy, grace_s: float = 3600.0, dry_run: bool = False,
            storage_options: dict | None = None, now: float | None = None) -> GcPlan:
    """Plan, then (unless ``dry_run``) remove. Checkpoints and stage folders are removed
    manifest-last where they have one (a reader never sees half of a committed thing as
    committed: without its marker it is simply gone); incomplete uploads are aborted."""
    plan = plan_gc(run_uri, policy, grace_s, storage_options, now)
    if dry_run:
        return plan
    for key_uri, upload_id in plan.uploads:
        loc = sfs.resolve(key_uri, storage_options)
        bucket, _, key = loc.path.partition("/")
        loc.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
    run = sfs.resolve(run_uri, storage_options)
    for uri in plan.all():
        loc = sfs.resolve(uri, storage_options)
        link = sfs.link_below(run, loc)
        if link is not None:  # never a delete through a link: the link itself goes, if it is the item
            if link == loc.path.rstrip("/"):
                os.unlink(link)
            continue
        for marker in (MANIFEST_NAME, TRAINER_STATE_FILE):  # the commit markers go first
            try:
                loc.fs.rm(loc.child(marker).path)
            except (FileNotFoundError, OSError):
                pass
        try:
            loc.fs.rm(loc.path, recursive=True)
        except FileNotFoundError:
            pass
        except OSError as exc:  # a file written into it meanwhile (ENOTEMPTY): the next pass decides
            if exc.errno != errno.ENOTEMPTY:
                raise
    return plan


def format_plan(plan: GcPlan, dry_run: bool, run_uri: str) -> str:
    verb = "would remove" if dry_run else "removed"
    base = run_uri.rstrip("/") + "/"
    rel = lambda uri: uri[len(base):] if uri.startswith(base) else uri  # noqa: E731
    stages: dict[str, list[str]] = {}
    for uri in plan.snapshots:  # one line per iteration: its stages go together
        iteration, _, stage = rel(uri).partition("/")
        stages.setdefault(iteration, []).append(stage)
    lines = [f"{verb} checkpoint: {rel(u)}" for u in plan.checkpoints]
    lines += [f"{verb} stage snapshots: {it} ({', '.join(names)})" for it, names in stages.items()]
    lines += [f"{verb} orphaned writer prefix: {rel(u)}" for u in plan.orphans]
    lines += [f"{verb} dead lease: {rel(u)}" for u in plan.leases]
    lines += [f"{verb} scratch file: {rel(u)}" for u in plan.scratch]
    lines += [f"{'would abort' if dry_run else 'aborted'} incomplete upload: {rel(u)}" for u, _ in plan.uploads]
    lines.append(f"{verb} {len(plan.all()) + len(plan.uploads)} item(s), {plan.bytes / 2**20:.1f} MiB")
    return "\n".join(lines)
