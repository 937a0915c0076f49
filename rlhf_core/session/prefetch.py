"""The next iteration's inference stages, computed while no controller is attached.

Between two iteration runs on Kubeflow the session's workers would wait for as long as
the next run's pods take to start. So right after a controller commits iteration N, it
asks the session to compute iteration N+1's inference stages (``stages.prefetchable``:
rollout, reward, old and reference log-probs, values) in the background. The controller
of N+1 adopts the result only when every part of its key matches what it would compute
from itself: run, iteration, config hash, the step the weights are at, the data cursor
and the session's generation (a rebuilt session has new workers). Otherwise it computes
the stages itself. The adopting controller writes the snapshots, under its lease, from
the same tensors the stages produced, so the store holds the same bytes either way.

Prefetching only reads worker state and writes nothing to the store, so it takes no
lease. It must never overlap a controller's stages, which the two actors of a session
guarantee together:

* a controller claims the workers on the session record before it runs anything (one
  call: it reads the step the weights are at, marks them dirty and voids every earlier
  claim), and takes (drains) the prefetcher before its first stage; a prefetch that does
  not match is cancelled at its next stage boundary and dropped;
* a controller's commit sets the record's step only while its claim is the latest, and
  the prefetcher starts only after the record confirms, under the prefetcher's lock, that
  the weights are at the key's step and generation and the claim that asks is still the
  latest. A start that loses the race to the next controller's claim is refused; one
  that wins it ran on weights that claim saw at the committed step, so that controller
  loads nothing and drains (adopts) it.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rlhf_core.config import RunConfig
from rlhf_core.trainer import stages as stage_table

if TYPE_CHECKING:
    from rlhf_core.protocol import DataProto

PREFETCH_ACTOR = "prefetch"
KEY_FIELDS = ("run_id", "iteration", "config_hash", "weights_step", "cursor", "generation")


def prefetch_key(cfg: RunConfig, run_id: str, state, weights_step: int | None, generation: int) -> dict:
    """What a computed-ahead result depends on (``state``: the controller's TrainerState
    at the start of the iteration)."""
    return {"run_id": run_id, "iteration": state.global_step, "config_hash": cfg.config_hash(),
            "weights_step": weights_step, "cursor": dict(state.cursor), "generation": generation}


def key_mismatch(wanted: dict, found: dict) -> list[str]:
    """The key fields that differ, as ``field: found != wanted`` lines."""
    return [f"{name}: {found.get(name)!r} != {wanted.get(name)!r}" for name in KEY_FIELDS
            if found.get(name) != wanted.get(name)]


@dataclass
class Prefetched:
    """An iteration's inference stages, computed ahead. ``batch`` is the batch after the
    last of them; ``stages`` holds per stage the columns and meta_info its output had,
    so each stage's snapshot is rebuilt from ``batch`` without keeping every
    intermediate batch (a column never changes once a stage has added it)."""

    key: dict
    batch: "DataProto"
    stages: list[dict]
    timing: dict = field(default_factory=dict)
    worker_time: dict = field(default_factory=dict)

    def snapshots(self):
        """(stage name, the batch as that stage returned it), in stage order."""
        from rlhf_core.protocol import DataProto

        for stage in self.stages:
            yield stage["name"], DataProto(
                batch=self.batch.batch.select(*stage["batch_keys"]) if stage["batch_keys"] else None,
                non_tensor_batch={k: self.batch.non_tensor_batch[k] for k in stage["non_tensor_keys"]},
                meta_info=copy.deepcopy(stage["meta_info"]))


def compute_ahead(cfg: RunConfig, workers, state, key: dict, cancelled=lambda: False) -> Prefetched | None:
    """Run the prefetchable stages of the iteration ``state`` is at (None when cancelled
    between two stages)."""
    from rlhf_core.trainer.ppo import PPOTrainer
    from rlhf_core.trainer.loaders import make_loader

    trainer = PPOTrainer(cfg, workers, make_loader(cfg, state), copy.deepcopy(state))
    batch = trainer.first_batch()
    done, timing = [], {}
    stages = stage_table.prefetchable(cfg)
    if cancelled():
        return None
    for stage, batch, seconds in trainer.run_stages(batch, stages):
        timing[stage.name] = seconds
        done.append({"name": stage.name, "batch_keys": list(batch.batch.keys()) if batch.batch is not None else [],
                     "non_tensor_keys": list(batch.non_tensor_batch), "meta_info": copy.deepcopy(batch.meta_info)})
        if stage is not stages[-1] and cancelled():  # checked between two stages
            return None
    return Prefetched(key, batch, done, timing, dict(trainer.worker_time))


@dataclass
class _Job:
    key: dict
    cancel: threading.Event
    thread: threading.Thread
    result: Prefetched | None = None
    error: str | None = None


class Prefetcher:
    """Detached actor of a session (threaded): computes ahead on the session's workers.

    The session (``rlhf_core.session.session.serve``) places it next to the record and ``reset``s
    it with every generation of workers; controllers ``start`` and ``take``."""

    def __init__(self, cfg: RunConfig, namespace: str, worker_role: str, record_name: str) -> None:
        self.cfg, self.namespace, self.worker_role, self.record_name = cfg, namespace, worker_role, record_name
        self.lock = threading.Lock()
        self.job: _Job | None = None
        self.workers, self.generation = None, None

    def reset(self, worker_names: list[str], generation: int) -> None:
        """New workers (a session generation): drop whatever was computed on the old ones."""
        from rlhf_core.workers.worker_set import WorkerSet

        with self.lock:
            self._drain()
            self.generation = generation
            self.workers = WorkerSet.attach(self.cfg, worker_names, namespace=self.namespace, role=self.worker_role)

    def start(self, key: dict, state: dict, claim: int | None = None) -> str:
        """Begin computing iteration ``state``'s inference stages in the background;
        returns "started" or why not."""
        import ray

        from rlhf_core.trainer.ppo import TrainerState

        with self.lock:
            self._drain()
            if self.workers is None or key.get("generation") != self.generation:
                return f"refused: the session is at generation {self.generation}, the key says {key.get('generation')}"
            record = ray.get_actor(self.record_name, namespace=self.namespace)
            if not ray.get(record.weights_at.remote(key["weights_step"], key["generation"], claim)):
                return "refused: a controller is changing the weights"
            cancel = threading.Event()
            job = _Job(key, cancel, threading.Thread(target=lambda: None, daemon=True))

            def work() -> None:
                try:
                    job.result = compute_ahead(self.cfg, self.workers, TrainerState(**state), key, cancel.is_set)
                except Exception as exc:  # reported to the controller, which then computes itself
                    job.error = f"{type(exc).__name__}: {exc}"

            job.thread = threading.Thread(target=work, name="prefetch", daemon=True)
            self.job = job
            job.thread.start()
            return "started"

    def take(self, key: dict) -> tuple[Prefetched | None, str]:
        """The result for ``key`` (waiting for it to finish), or None and why. Nothing is
        left running on the workers when this returns."""
        with self.lock:
            job, self.job = self.job, None
            if job is None:
                return None, "nothing was prefetched"
            differs = key_mismatch(key, job.key)
            if differs:
                job.cancel.set()
                job.thread.join()
                return None, "prefetched for another state (" + "; ".join(differs) + ")"
            job.thread.join()
            if job.result is None:
                return None, f"prefetch failed ({job.error})"
            return job.result, "adopted"

    def _drain(self) -> None:
        if self.job is not None:
            self.job.cancel.set()
            self.job.thread.join()
            self.job = None


class SessionPrefetch:
    """The controller's side (``PPOTrainer.prefetch``): the key from what the controller
    knows, the session's answer, a log line."""

    def __init__(self, cfg: RunConfig, run_id: str, prefetcher, weights_step: int | None, generation: int,
                 log=print, claim: int | None = None) -> None:
        self.cfg, self.run_id, self.prefetcher, self.claim = cfg, run_id, prefetcher, claim
        self.weights_step, self.generation, self.log = weights_step, generation, log
        self.notes: list[str] = []  # one line per decision, for the caller's summary

    def take(self, state) -> Prefetched | None:
        import ray

        result, why = ray.get(self.prefetcher.take.remote(
            prefetch_key(self.cfg, self.run_id, state, self.weights_step, self.generation)))
        if result is not None and [s["name"] for s in result.stages] != [
                s.name for s in stage_table.prefetchable(self.cfg)]:
            result, why = None, "prefetched other stages"
        self.notes.append(f"iteration {state.global_step}: " + (
            f"adopting the stages computed ahead ({', '.join(s['name'] for s in result.stages)})"
            if result is not None else f"computing every stage ({why})"))
        self.log(f"[rlhf] {self.notes[-1]}")
        self.weights_step = None  # after this iteration the weights move on
        return result

    def start_next(self, state) -> str:
        """Right after a commit: compute the next iteration ahead (its weights are now at
        ``state.global_step``)."""
        import ray

        key = prefetch_key(self.cfg, self.run_id, state, state.global_step, self.generation)
        status = ray.get(self.prefetcher.start.remote(key, {"global_step": state.global_step,
                                                          "cursor": dict(state.cursor), "kl_coef": state.kl_coef},
                                                         self.claim))
        self.notes.append(f"computing iteration {state.global_step} ahead: {status}")
        self.log(f"[rlhf] {self.notes[-1]}")
        return status
