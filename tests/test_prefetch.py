"""Computing ahead never overlaps a controller: the session's prefetcher refuses to start
while a controller has marked the weights dirty, and a controller's ``take`` returns only
when nothing computed ahead is still running on the workers (it waits for a matching
result, cancels and drains one computed for another state). The prefetcher runs in this
process with the work replaced by a probe that records when it runs; the session record
is a real Ray actor."""

from __future__ import annotations

import threading

import pytest

from rlhf_core.session import session
from rlhf_core.config import RunConfig
from rlhf_core.session import prefetch
from rlhf_core.trainer.ppo import TrainerState

NAMESPACE = "rlhf-test-prefetch"


class ProbeWork:
    """Stands for ``compute_ahead``: runs until released (or cancelled), and records
    whether it is running."""

    def __init__(self) -> None:
        self.release, self.started = threading.Event(), threading.Event()
        self.running, self.cancelled_seen = False, False

    def __call__(self, cfg, workers, state, key, cancelled):
        self.running = True
        self.started.set()
        try:
            while not self.release.wait(0.01):
                if cancelled():
                    self.cancelled_seen = True
                    return None
            return prefetch.Prefetched(key, batch=None, stages=[], timing={}, worker_time={})
        finally:
            self.running = False


@pytest.fixture
def parts(ray_local, monkeypatch):
    import ray

    cfg = RunConfig()
    record = ray.remote(session.SessionRecord).options(name="record", namespace=NAMESPACE).remote(
        {"status": "ready", "step": 5, "generation": 1})
    prefetcher = prefetch.Prefetcher(cfg, NAMESPACE, "worker", "record")
    prefetcher.workers, prefetcher.generation = object(), 1  # what reset() sets from a live session
    probe = ProbeWork()
    monkeypatch.setattr(prefetch, "compute_ahead", probe)
    yield cfg, record, prefetcher, probe
    probe.release.set()
    ray.kill(record)


def key_for(cfg, step: int) -> dict:
    return prefetch.prefetch_key(cfg, "run", TrainerState(global_step=step), step, 1)


def test_no_computing_ahead_while_a_controller_has_the_weights_dirty(parts):
    import ray

    cfg, record, prefetcher, probe = parts
    ray.get(record.update.remote(step=None))  # a controller attached: the weights are about to change
    assert prefetcher.start(key_for(cfg, 5), {"global_step": 5}) == "refused: a controller is changing the weights"
    assert not probe.started.is_set() and prefetcher.job is None
    ray.get(record.update.remote(step=5))  # it committed step 5: computing ahead may start
    assert prefetcher.start(key_for(cfg, 5), {"global_step": 5}) == "started"
    assert probe.started.wait(30)


def test_take_waits_for_the_work_under_way_before_the_controller_goes_on(parts):
    cfg, record, prefetcher, probe = parts
    assert prefetcher.start(key_for(cfg, 5), {"global_step": 5}) == "started"
    assert probe.started.wait(30)
    taken = {}
    controller = threading.Thread(target=lambda: taken.update(result=prefetcher.take(key_for(cfg, 5))))
    controller.start()
    controller.join(0.5)
    assert controller.is_alive() and probe.running  # the controller waits: the work still runs
    probe.release.set()
    controller.join(30)
    assert not controller.is_alive() and not probe.running
    result, why = taken["result"]
    assert why == "adopted" and result.key == key_for(cfg, 5)


def test_take_for_another_state_cancels_and_drains_the_work(parts):
    cfg, record, prefetcher, probe = parts
    assert prefetcher.start(key_for(cfg, 5), {"global_step": 5}) == "started"
    assert probe.started.wait(30)
    result, why = prefetcher.take(key_for(cfg, 6))  # the run moved elsewhere (e.g. rolled back)
    assert result is None and why.startswith("prefetched for another state (iteration: 5 != 6")
    assert probe.cancelled_seen and not probe.running and prefetcher.job is None
    assert prefetcher.take(key_for(cfg, 6)) == (None, "nothing was prefetched")


def test_a_controller_that_committed_cannot_start_work_under_the_next_ones_claim(parts):
    """The old controller ends (commit: the record's step, then computing ahead) while the
    next one claims the workers, the two at the same time, many rounds. Whatever the
    order, nothing runs ahead on workers the new controller reloads: either its claim saw
    the committed step (it loads nothing and adopts the work), or the old one's step and
    start were refused and the record stays dirty."""
    import ray

    cfg, record, prefetcher, probe = parts
    probe.release.set()  # the work ends at once: each round starts from an idle prefetcher
    seen = {"reload": 0, "adopt": 0}
    for round_ in range(30):
        step = 6 + round_
        old = ray.get(record.claim.remote(f"old-{round_}"))
        barrier, out = threading.Barrier(2), {}

        def old_controller():
            barrier.wait()
            out["committed"] = ray.get(record.committed.remote(old["claim"], step))
            out["start"] = prefetcher.start(key_for(cfg, step), {"global_step": step}, old["claim"])

        def new_controller():
            barrier.wait()
            out["claimed"] = ray.get(record.claim.remote(f"new-{round_}"))

        threads = [threading.Thread(target=old_controller), threading.Thread(target=new_controller)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        if out["claimed"]["step"] == step:  # the claim came after the commit: nothing to reload
            seen["adopt"] += 1
        else:  # the new controller reloads: the old one changed nothing and started nothing
            seen["reload"] += 1
            assert out["claimed"]["step"] is None and not out["committed"], out
            assert out["start"] == "refused: a controller is changing the weights", out
            assert ray.get(record.get.remote())["step"] is None
        prefetcher.take(key_for(cfg, step))  # the new controller drains whatever was started
    assert seen["adopt"] + seen["reload"] == 30
