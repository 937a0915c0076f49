"""Asynchronous training's rollout side: the coming trainer steps' batches, generated on
the rollout pool while the trainer trains (``async_training.enable``).

A thread of the controller generates step after step: step j's batch is exactly the one a
synchronous run would generate for step j (the same prompts from a loader of its own at
the same cursor, the same sample seeds, the same chunks over the replicas), on the
weights the rollout pool holds when the batch starts, whose version (the trainer step
that made them) every row records. It may start step j only while

    j < next_sync(version) + floor(staleness_threshold x trigger_parameter_sync_step)

(``steps_allowed``), where ``next_sync`` is the first trainer step after ``version`` at
which the trainer sends weights: verl's bound on stale samples, counted in whole steps'
batches so that what a batch is never depends on timing. Only which version made it
does, and that is recorded.

The trainer takes step k's batch in step order (``take``: it waits when the batch is not
done), and pauses the thread around everything else it asks of the replicas (a weight
sync, validation): one caller of the replicas at a time.

What this gives the record: a trainer step's batch is committed as its ``rollout``
snapshot, so a step is consumed exactly once; batches generated ahead and not consumed
when the controller stops (or dies) are not committed, and the next controller generates
them again from the same prompts and seeds at the step it resumes from (on the weights
it holds then): none is lost, none is trained on twice, and every step consumes the
prompts a synchronous run would.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable



def next_sync(version: int, sync_every: int) -> int:
    """The first trainer step after weights of ``version`` at which the trainer sends new
    weights (a step k syncs when k + 1 is a multiple of ``sync_every``; the weights then
    have version k + 1)."""
    return (version // sync_every + 1) * sync_every


def steps_allowed(version: int, sync_every: int, staleness_threshold: float) -> int:
    """The first step whose batch weights of ``version`` may not start: the steps up to
    the next sync, plus ``floor(staleness_threshold x sync_every)`` more."""
    return next_sync(version, sync_every) + int(staleness_threshold * sync_every + 1e-9)


@dataclass
class Generated:
    """One step's batch as generated: the prompt rows it was asked for, the rollout's
    columns for them (``weight_version`` included), and what generating it measured
    (timings: never data)."""

    step: int
    prompts: object
    out: object
    timing: dict = field(default_factory=dict)
    seconds: float = 0.0


class RolloutStopped(RuntimeError):
    """The rollouter stopped before the step asked for was generated."""


class Rollouter:
    """Generates steps ``[first_step, until_step)`` ahead of the trainer.

    ``prompts_of_next_step(step)``: the next step's seeded prompt rows (a loader of the
    rollouter's own, at the cursor of ``first_step``); ``generate(prompts, version)``: the
    rollout's columns for them on the replicas' weights of ``version`` and the timing
    measured (the manager's call, or an agent loop's rounds of calls). ``version``: the
    weights the replicas hold."""

    def __init__(self, cfg, prompts_of_next_step: Callable[[int], object], generate: Callable,
                 first_step: int, until_step: int, version: int) -> None:
        self.cfg = cfg
        self._prompts_of = prompts_of_next_step
        self._generate = generate
        self.version = version
        self._next = first_step
        self._until = until_step
        self._done: dict[int, Generated] = {}
        self._cond = threading.Condition()
        self._pause_asked = 0
        self._busy = False
        self._waiting = False  # the thread waits (paused, at its bound or past the last step)
        self._stopping = False
        self._error: BaseException | None = None
        self.waited_on_bound_s = 0.0   # the rollout's pauses at its staleness bound (since the last take)
        self.generated_steps = 0
        self._thread = threading.Thread(target=self._loop, name="rollouter", daemon=True)

    # ------------------------------------------------------------ the trainer's side

    def start(self) -> "Rollouter":
        self._thread.start()
        return self

    def take(self, step: int) -> tuple[Generated, float, int]:
        """Step ``step``'s batch (waiting until it is generated), the seconds waited, and how
        many later steps' batches were already done (the queue)."""
        t0 = time.perf_counter()
        with self._cond:
            while step not in self._done:
                if self._error is not None:
                    raise RuntimeError(f"rollout: generating ahead failed: {self._error}") from self._error
                if self._stopping or step >= self._until:
                    raise RolloutStopped(f"rollout: step {step} is not generated (the rollouter covers steps "
                                         f"before {self._until} and is {'stopping' if self._stopping else 'running'})")
                self._cond.wait()
            generated = self._done.pop(step)
            queued = len(self._done)
            self._cond.notify_all()
        return generated, time.perf_counter() - t0, queued

    def pause(self) -> None:
        """Start no further batch and wait for the one under way (the replicas are the
        caller's until ``resume``)."""
        with self._cond:
            self._pause_asked += 1
            self._cond.notify_all()
            while self._busy:
                self._cond.wait()

    def resume(self, version: int | None = None) -> None:
        """Generate on, with the replicas at ``version`` (None: as they were)."""
        with self._cond:
            if version is not None:
                self.version = version
            self._pause_asked -= 1
            self._cond.notify_all()

    def stop(self) -> None:
        """Stop after the batch under way (its result is dropped, as everything not taken)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()

    def wait_at_bound(self) -> bool:
        """Wait until the thread waits at its staleness bound (or at the run's end) with
        nothing under way; False if it failed instead. What tests wait on, never time."""
        with self._cond:
            self._cond.wait_for(lambda: self._error is not None or (
                self._waiting and not self._pause_asked and not self._startable()))
            return self._error is None

    def wait_pause_asked(self) -> None:
        """Wait until some caller has asked for a pause (tests)."""
        with self._cond:
            self._cond.wait_for(lambda: self._pause_asked > 0)

    def metrics(self) -> dict:
        """The rollout side's counters under verl's fully-async names, since the last call."""
        out = {"fully_async/count/current_param_version": float(self.version),
               "fully_async/rollouter/waited_on_bound_s": self.waited_on_bound_s}
        self.waited_on_bound_s = 0.0
        return out

    # ------------------------------------------------------------ the thread

    def _startable(self) -> bool:
        cfg = self.cfg.async_training
        return self._next < min(self._until, steps_allowed(self.version, cfg.trigger_parameter_sync_step,
                                                           cfg.staleness_threshold))

    def _loop(self) -> None:
        while True:
            with self._cond:
                waiting_since = None
                while not self._stopping and (self._pause_asked or not self._startable()):
                    if not self._pause_asked and self._next < self._until and waiting_since is None:
                        waiting_since = time.perf_counter()  # at the staleness bound, not paused by the trainer
                    self._waiting = True
                    self._cond.notify_all()
                    self._cond.wait()
                self._waiting = False
                if waiting_since is not None:
                    self.waited_on_bound_s += time.perf_counter() - waiting_since
                if self._stopping:
                    return
                step, version = self._next, self.version
                self._next += 1
                self._busy = True
            try:
                generated = self._generate_step(step, version)
            except BaseException as exc:  # noqa: BLE001 - handed to the trainer, which raises it
                with self._cond:
                    self._error, self._busy = exc, False
                    self._cond.notify_all()
                return
            with self._cond:
                self._done[step] = generated
                self.generated_steps += 1
                self._busy = False
                self._cond.notify_all()

    def _generate_step(self, step: int, version: int) -> Generated:
        prompts = self._prompts_of(step)
        t0 = time.perf_counter()
        out, timing = self._generate(prompts, version)
        return Generated(step, prompts, out, timing, time.perf_counter() - t0)
