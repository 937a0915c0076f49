"""Asynchronous training (``async_training.*``, verl's fully-async keys): the rollout pool
generates the coming steps' batches while the trainer trains, within a staleness bound;
every row records the weights that made it; a run killed anywhere consumes the prompts an
uninterrupted run consumes, each once; every committed step replays exactly."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from rlhf_core.config import ConfigError, RunConfig, apply_overrides
from rlhf_core.trainer.rollouter import Generated, Rollouter, next_sync, steps_allowed

OWN_POOL = ["rollout.mode=async", "rollout.nnodes=1", "rollout.checkpoint_engine.backend=gloo"]
ASYNC = [*OWN_POOL, "async_training.enable=true"]


def test_the_bound_counts_whole_steps_up_to_the_next_sync_plus_the_staleness_share():
    assert [next_sync(v, 4) for v in (0, 3, 4, 5)] == [4, 4, 8, 8]
    assert steps_allowed(0, 1, 0.0) == 1        # synchronous: the step of the weights held
    assert steps_allowed(0, 1, 1.0) == 2        # one-step-off-policy
    assert steps_allowed(4, 4, 0.5) == 10       # up to the sync at 8, plus 2 steps
    assert steps_allowed(4, 4, 0.1) == 8        # 0.4 of a step: no whole step more
    assert steps_allowed(5, 4, 0.25) == 9       # a version between syncs (a resumed run's)


def test_the_async_keys_are_checked_each_refusal_naming_its_key():
    small = ["data.train_batch_size=8", "actor.ppo_mini_batch_size=8"]
    cfg = apply_overrides(RunConfig(), [*small, *ASYNC]).validate()
    assert cfg.old_log_prob_column == "rollout_log_probs"  # verl's default: the behaviour policy's
    prox = apply_overrides(RunConfig(), [*small, *ASYNC, "async_training.compute_prox_log_prob=true"]).validate()
    assert prox.old_log_prob_column == "old_log_probs" and prox.runs_old_log_prob_stage
    for overrides, message in [
        ([*small, *ASYNC[1:]], r"^rollout.mode: expected async"),
        ([*small, "async_training.enable=true"], r"^async_training.enable: expected a rollout pool of its own"),
        (["data.train_batch_size=16", "actor.ppo_mini_batch_size=8", *ASYNC],
         r"^async_training.require_batches: expected .* found 1 x 8 = 8 against 16$"),
        ([*small, *ASYNC, "async_training.staleness_threshold=-1"], r"^async_training.staleness_threshold"),
        ([*small, *ASYNC, "async_training.trigger_parameter_sync_step=0"],
         r"^async_training.trigger_parameter_sync_step"),
        ([*small, *ASYNC, "trainer.total_iterations=3", "async_training.trigger_parameter_sync_step=4"],
         r"^async_training.trigger_parameter_sync_step: expected at most the run's 3 trainer steps"),
        ([*small, *ASYNC, "async_training.partial_rollout=true", "async_training.staleness_threshold=0.25"],
         r"^async_training.partial_rollout: expected false"),
        ([*small, *ASYNC, "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc"],
         r"^async_training.enable: expected false with algorithm.filter_groups.enable"),
        ([*small, *ASYNC, "algorithm.adv_estimator=remax"],
         r"^async_training.enable: expected false with algorithm.adv_estimator=remax"),
        ([*small, *ASYNC, "algorithm.rollout_correction.rollout_is=token",
          "algorithm.rollout_correction.bypass_mode=false"],
         r"^async_training.compute_prox_log_prob: expected true"),
        ([*small, *ASYNC, "rollout.top_p=0.9"], r"^async_training.use_rollout_log_probs: expected false"),
    ]:
        with pytest.raises(ConfigError, match=message):
            apply_overrides(RunConfig(), overrides).validate()
    # verl's fully-async keys outside the section's own fields: mapped, noted or refused
    notes = []
    cfg = apply_overrides(RunConfig(), ["async_training.checkpoint_engine.device_buffer_size_M=64",
                                        "async_training.checkpoint_engine.enable=True", "rollout.total_epochs=2",
                                        "async_training.use_trainer_do_validate=False"], notes=notes)
    assert (cfg.rollout.checkpoint_engine.update_weights_bucket_megabytes, cfg.trainer.total_epochs) == (64, 2)
    assert len(notes) == 2 and all("verl's default" in note for note in notes)
    for key in ("async_training.use_trainer_do_validate=true",
                "async_training.checkpoint_engine.overlap_broadcast_and_consume=true"):
        with pytest.raises(ValueError, match=f"^verl key '{key.split('=')[0]}'"):
            apply_overrides(RunConfig(), [key])
    # verl's fully-async counting: a step of require_batches mini-batches, totals in prompts, validation per sync
    cfg = apply_overrides(RunConfig(), [*ASYNC, "data.train_batch_size=0", "data.gen_batch_size=1",
                                        "actor.ppo_mini_batch_size=4", "async_training.require_batches=2",
                                        "rollout.total_rollout_steps=100", "rollout.test_freq=3",
                                        "async_training.trigger_parameter_sync_step=2"]).validate()
    assert (cfg.data.train_batch_size, cfg.trainer.total_iterations, cfg.trainer.test_freq) == (8, 12, 6)
    assert cfg.validate().trainer.total_iterations == 12  # resolved once
    for overrides, message in [(["data.train_batch_size=0"], r"^data.train_batch_size: expected > 0"),
                               (["rollout.total_rollout_steps=5"], r"^rollout.total_rollout_steps: expected 0 without"),
                               ([*small, "data.gen_batch_size=1"], r"^data.gen_batch_size: differs")]:
        with pytest.raises(ConfigError, match=message):
            apply_overrides(RunConfig(), overrides).validate()
    # partial_rollout where no batch is in flight at a sync (less than a whole step beyond it): no effect
    apply_overrides(RunConfig(), [*small, *ASYNC, "async_training.partial_rollout=true",
                                  "async_training.staleness_threshold=0.1"]).validate()


def test_sections_added_later_leave_an_older_runs_config_hash_while_they_are_off():
    """A run committed before async_training and distillation existed resumes: while off,
    neither section (nor verl's fully-async counters) is part of the hash; on, they are."""
    base = RunConfig().config_hash()
    assert base == "53b523858c6e1e8d27c53daf331dced2ef34fbe357cdef0883d340a2d4dcf62d"  # the default's, before them
    off = apply_overrides(RunConfig(), ["async_training.staleness_threshold=0.5",
                                        "distillation.distillation_loss.distillation_loss_coef=0.5"])
    assert off.config_hash() == base
    assert apply_overrides(RunConfig(), ASYNC).config_hash() != base


class FakeReplicas:
    """The manager's call, recording (step, version) per call; a call can be held until
    the test releases it."""

    def __init__(self):
        self.calls, self.hold = [], {}
        self.started = threading.Condition()

    def generate(self, prompts, version):
        import torch

        from rlhf_core.protocol import DataProto

        step = int(prompts.batch["sample_seed"][0])
        gate = self.hold.get(step)
        with self.started:
            self.calls.append((step, version))
            self.started.notify_all()
        if gate is not None:
            gate.wait()
        return DataProto.from_dict({"weight_version": torch.tensor([version])}), {}

    def wait_for_calls(self, count):
        with self.started:
            self.started.wait_for(lambda: len(self.calls) >= count)


def make_rollouter(replicas, cfg, first=0, until=10, version=0):
    import torch

    from rlhf_core.protocol import DataProto

    def prompts_of(step):  # one row per step, its seed the step: the fake replicas read it back
        return DataProto.from_dict({"input_ids": torch.tensor([[1, 2]]), "attention_mask": torch.ones(1, 2),
                                    "sample_seed": torch.tensor([step])})

    return Rollouter(cfg, prompts_of, replicas.generate, first, until, version)


def async_cfg(sync_every, staleness):
    return apply_overrides(RunConfig(), [f"async_training.trigger_parameter_sync_step={sync_every}",
                                         f"async_training.staleness_threshold={staleness}"])


def test_the_rollouter_runs_ahead_to_its_bound_and_on_after_each_sync():
    replicas = FakeReplicas()
    rollouter = make_rollouter(replicas, async_cfg(1, 1.0)).start()
    try:
        replicas.wait_for_calls(2)
        rollouter.take(0)
        rollouter.take(1)
        assert rollouter.wait_at_bound() and replicas.calls == [(0, 0), (1, 0)]  # one step off: 0 and 1 on v0
        rollouter.pause()
        rollouter.resume(version=1)  # the trainer's sync after step 0
        replicas.wait_for_calls(3)
        assert rollouter.take(2)[0].out.batch["weight_version"].tolist() == [1] and rollouter.wait_at_bound()
        assert replicas.calls == [(0, 0), (1, 0), (2, 1)]
    finally:
        rollouter.stop()


def test_a_pause_waits_for_the_batch_under_way_and_starts_none_until_resumed():
    replicas = FakeReplicas()
    replicas.hold[0] = gate = threading.Event()
    rollouter = make_rollouter(replicas, async_cfg(1, 3.0)).start()
    paused = threading.Event()
    try:
        replicas.wait_for_calls(1)
        pauser = threading.Thread(target=lambda: (rollouter.pause(), paused.set()))
        pauser.start()
        rollouter.wait_pause_asked()
        assert not paused.is_set()          # step 0 is still being generated
        gate.set()
        pauser.join()
        assert paused.is_set() and replicas.calls == [(0, 0)]  # no step started while paused
        generated, _, queued = rollouter.take(0)
        assert isinstance(generated, Generated) and queued == 0
        rollouter.resume()
        replicas.wait_for_calls(4)          # steps 1..3 (three steps ahead of version 0 + 1)
        assert rollouter.wait_at_bound() and [c[0] for c in replicas.calls] == [0, 1, 2, 3]
    finally:
        rollouter.stop()


def test_a_failed_generation_reaches_the_trainer_at_its_next_take():
    def broken(prompts, version):
        raise RuntimeError("every replica died")

    rollouter = make_rollouter(FakeReplicas(), async_cfg(1, 0.0))
    rollouter._generate = broken
    rollouter.start()
    with pytest.raises(RuntimeError, match="generating ahead failed: every replica died"):
        rollouter.take(0)
    rollouter.stop()


# ------------------------------------------------------------------ whole runs


def _common(tmp_path, *more):
    return ["data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "rollout.n=4", "trainer.progress=false",
            "trainer.cpus_per_worker=1", "actor.ppo_epochs=2", f"trainer.output_dir={tmp_path / 'out'}", *more]


def _rows(tmp_path, run):
    return [json.loads(line) for line in (tmp_path / "out" / run / "metrics.jsonl").read_text().splitlines()]


def test_at_zero_staleness_async_training_is_the_synchronous_run_and_one_step_off_replays(tmp_path, ray_local):
    """staleness 0, a sync every step: each batch waits for the last update's weights, so
    the run is the synchronous run with a rollout pool of its own, bit for bit. One step
    off (staleness 1): batches are generated ahead on older weights, each row records
    which, and every stage of every step replays exactly (the rollout on those weights)."""
    from rlhf_core.cli import main
    from rlhf_core.record.iteration_store import IterationStore
    from rlhf_core.record.run_layout import RunRef
    from rlhf_core.trainer.replay import replay

    store = f"file://{tmp_path / 'store'}"
    keep = ["async_training.trigger_parameter_sync_step=1", "async_training.use_rollout_log_probs=false"]
    assert main(["run", "--direct", "--iterations", "3", "--run-id", "sync", "--store", store,
                 *_common(tmp_path, *OWN_POOL)]) == 0
    assert main(["run", "--direct", "--iterations", "3", "--run-id", "zero", "--store", store,
                 *_common(tmp_path, *ASYNC, *keep, "async_training.staleness_threshold=0")]) == 0
    keys = ("critic/score/mean", "actor/pg_loss", "actor/entropy")
    assert [[r[k] for k in keys] for r in _rows(tmp_path, "zero")] == \
        [[r[k] for k in keys] for r in _rows(tmp_path, "sync")]
    assert [r["fully_async/staleness/max"] for r in _rows(tmp_path, "zero")] == [0.0, 0.0, 0.0]

    assert main(["run", "--direct", "--iterations", "4", "--run-id", "off", "--store", store,
                 *_common(tmp_path, *ASYNC, "async_training.trigger_parameter_sync_step=1",
                          "async_training.staleness_threshold=1")]) == 0
    istore = IterationStore(RunRef(store, "off"))
    versions = [set(istore.load(n, "rollout").batch["weight_version"].tolist()) for n in range(4)]
    assert all(len(v) == 1 and 0 <= n - min(v) <= 1 for n, v in enumerate(versions)), versions
    assert any(n - min(v) == 1 for n, v in enumerate(versions)), versions  # generated ahead at least once
    rows = _rows(tmp_path, "off")
    assert all(r["fully_async/staleness/max"] <= 1 for r in rows)
    assert [istore.load(n, "rollout").non_tensor_batch["uid"].tolist() for n in range(4)] == \
        [IterationStore(RunRef(store, "sync")).load(n, "rollout").non_tensor_batch["uid"].tolist()
         for n in range(3)] + [istore.load(3, "rollout").non_tensor_batch["uid"].tolist()]
    stale = next(n for n, v in enumerate(versions) if n - min(v) == 1)
    for r in replay(f"{store}/off/iter-{stale:06d}", log=lambda *a: None):
        assert r.ok and r.diffs and all(d.max_abs == 0 for d in r.diffs), (r.stage, [d for d in r.diffs
                                                                                      if not d.equal])


class Crash(RuntimeError):
    pass


def test_a_run_killed_in_generation_update_weight_sync_and_commit_consumes_each_prompt_once(tmp_path, ray_local,
                                                                                             monkeypatch):
    """Crashed at each point where the rollout has generated ahead (the start of a step's
    rollout, its update, its weight sync, its commit) and resumed each time: the steps
    consume exactly the prompts, in the same order, that an uninterrupted run consumes;
    no step is lost or run twice, and the run ends at the same step."""
    from rlhf_core.record.iteration_store import IterationStore
    from rlhf_core.record.run_layout import RunRef
    from rlhf_core.runtime import probes
    from rlhf_core.trainer.run import run_direct

    cfg = apply_overrides(RunConfig(), _common(tmp_path, *ASYNC, "async_training.trigger_parameter_sync_step=1",
                                               "async_training.staleness_threshold=2"))
    quiet, total = (lambda *a: None), 5
    whole = RunRef(f"file://{tmp_path / 'whole'}", "run")
    run_direct(cfg, total, whole, log=quiet)

    killed = RunRef(f"file://{tmp_path / 'killed'}", "run")
    istore = IterationStore(killed)

    def at(iteration, stage):
        def hook(it, name):
            if (it, name) == (iteration, stage):
                raise Crash(f"at iteration {it}, stage {name}")
        return hook

    for iteration, stage in [(1, "rollout"), (2, "update_actor"), (2, "weight_sync")]:
        with pytest.raises(Crash):
            run_direct(cfg, total - len(istore.committed_iterations()), killed, log=quiet, on_stage=at(iteration, stage))
    reached = probes.reached

    def commit_crash(point):
        if point == "commit:3":
            raise Crash(point)
        reached(point)

    monkeypatch.setattr(probes, "reached", commit_crash)
    with pytest.raises(Crash):
        run_direct(cfg, total - len(istore.committed_iterations()), killed, log=quiet)
    monkeypatch.setattr(probes, "reached", reached)
    assert istore.committed_iterations() == [0, 1, 2]
    result = run_direct(cfg, total - len(istore.committed_iterations()), killed, log=quiet)
    assert [r["iteration"] for r in result["rows"]] == [3, 4]

    def consumed(ref):
        store = IterationStore(ref)
        return [store.load(n, "rollout").non_tensor_batch["uid"].tolist() for n in store.committed_iterations()]

    assert consumed(killed) == consumed(whole) and len(consumed(whole)) == total
    assert istore.read_manifest(total - 1)["global_step"] == total
    for n in range(total):  # every consumed row was generated within the bound
        versions = istore.load(n, "rollout").batch["weight_version"]
        assert bool(((n - versions) >= 0).all() and ((n - versions) <= 2).all()), (n, versions)
    # the lineage says, per step, which weights generated its rows
    from rlhf_core.record.lineage import chain, format_lineage

    rows = chain(istore.run_uri)
    assert {r["iteration"]: r["weight_versions"] for r in rows} == {
        n: sorted(set(istore.load(n, "rollout").batch["weight_version"].tolist())) for n in range(total)}
    assert format_lineage(rows).count("rollout on weights of step") == total


def test_async_training_with_the_tool_agent_loop_records_and_replays(tmp_path, ray_local):
    """The calculator task's agent loop under one-step-off training: each step's
    trajectories (turns, tool calls and answers) are generated ahead on the rollout pool,
    every row records its weights, and a step generated on older weights replays exactly
    (the rollout on those weights, the recorded answers given again)."""
    from rlhf_core.cli import main
    from rlhf_core.record.iteration_store import IterationStore
    from rlhf_core.record.run_layout import RunRef
    from rlhf_core.trainer.replay import replay

    store = f"file://{tmp_path / 'store'}"
    assert main(["run", "--direct", "--config", str(Path(__file__).resolve().parents[1] / "examples" / "agent" / "calculator.yaml"), "--iterations", "3", "--run-id",
                 "agent", "--store", store, "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "rollout.n=2",
                 "trainer.progress=false", "trainer.cpus_per_worker=1", f"trainer.output_dir={tmp_path / 'out'}",
                 *ASYNC, "async_training.trigger_parameter_sync_step=1", "async_training.staleness_threshold=1"]) == 0
    istore = IterationStore(RunRef(store, "agent"))
    rollouts = [istore.load(n, "rollout") for n in range(3)]
    versions = [set(r.batch["weight_version"].tolist()) for r in rollouts]
    assert all(len(v) == 1 and 0 <= n - min(v) <= 1 for n, v in enumerate(versions)), versions
    assert all("agent/tool_calls" in r.non_tensor_batch for r in rollouts)
    assert any(calls for r in rollouts for calls in r.non_tensor_batch["agent/tool_calls"].tolist())
    stale = next((n for n, v in enumerate(versions) if n - min(v) == 1), None)
    assert stale is not None, versions
    for r in replay(f"{store}/agent/iter-{stale:06d}", stages=["rollout", "reward"], log=lambda *a: None):
        assert r.ok and r.diffs, (r.stage, [d for d in r.diffs if not d.equal])
