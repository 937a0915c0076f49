"""The controller: one PPO/GRPO iteration as named stages over WorkerGroups.

Read ``run_iteration`` and the stage methods below it top to bottom: each stage calls a
WorkerGroup (or a pure function from ``rlhf_core.algorithms``) and extends the batch.
Everything an iteration produces lives in the batch (metrics of the update stages go to
``meta_info["stage_metrics"]``), so a stage's output can be persisted, and a resumed
iteration can start from the last persisted stage. Timings are the only thing kept
outside the batch: they are measurements, not results.
"""

from __future__ import annotations

import time

import numpy as np
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

import torch

from rlhf_core.algorithms import (
    AdaptiveKLController, FixedKLController, apply_kl_penalty, get_adv_estimator_fn, pf_ppo_weights, rollout_correction,
    varied_groups,
)
from rlhf_core.config import RunConfig
from rlhf_core.data.dataset import Cursor
from rlhf_core.protocol import DataProto
from rlhf_core.rollout import engine_class, requests_of, responses_of, sampling_of
from rlhf_core.rollout.engine import completions_of, prompts_of
from rlhf_core.rollout.manager import RayReplicaTransport, RolloutManager, replicas_of
from rlhf_core.runtime import probes
from rlhf_core.trainer import stages as stage_table
from rlhf_core.trainer.metrics import compute_data_metrics, reduce_metrics, validation_metrics
from rlhf_core.workers import modeling
from rlhf_core.workers.reward_loop import CALLS_COLUMN as JUDGE_CALLS

#: What a model forward needs; stages send workers only the columns they read.
SEQUENCE_KEYS = ["input_ids", "attention_mask", "position_ids", "responses"]


@dataclass
class TrainerState:
    """Everything the controller needs to continue a run exactly."""

    global_step: int = 0
    cursor: dict = field(default_factory=lambda: {"epoch": 0, "position": 0})
    kl_coef: float = 0.0


class StageStore(Protocol):
    """Where stage outputs go (see ``rlhf_core.record.iteration_store``)."""

    def has(self, iteration: int, stage: str) -> bool: ...

    def load(self, iteration: int, stage: str, standalone: bool = False) -> DataProto: ...

    def save(self, iteration: int, stage: str, batch: DataProto, standalone: bool = False) -> None: ...

    def stage_uri(self, iteration: int, stage: str) -> str: ...

    def flush(self) -> None: ...


class PrefetchSource(Protocol):
    """The session's computed-ahead inference stages (see ``rlhf_core.session.prefetch``)."""

    def take(self, state: TrainerState):
        """The prefetched result for this state, or None; either way nothing is still
        running on the workers when it returns."""
        ...


def seeded_prompts(batch: DataProto, cfg: RunConfig) -> tuple[DataProto, DataProto]:
    """A step's prompt batch as the rollout samples it: each prompt repeated
    ``rollout.n`` times (the rows share its uid), one ``sample_seed`` per row (its sample
    does not depend on batching, restarts or which thread generates it; filter_groups'
    further generation batches: seeds after the earlier ones'). Returns the batch without
    the prompt columns, and those columns (the engines' input)."""
    step = batch.meta_info["global_step"]
    batch = batch.repeat(cfg.rollout.n, interleave=True)
    first = step * 1_000_003 + batch.meta_info.get("generation", 0) * len(batch)
    batch.batch["sample_seed"] = cfg.rollout.seed + first + torch.arange(len(batch))
    return batch, batch.pop(batch_keys=["input_ids", "attention_mask", "position_ids", "sample_seed"])


#: A replayed validation's meta_info key: the judge's recorded answers to its responses.
RECORDED_JUDGE_CALLS = "recorded_judge_calls"
#: A replayed agent rollout's meta_info key: sample seed -> the row's recorded tool calls.
RECORDED_TOOL_CALLS = "recorded_tool_calls"


def resumed_state(meta: dict, where: str) -> tuple[float | None, Cursor | None]:
    """(KL coefficient, prompt cursor) a committed stage's snapshot carries for a resumed
    iteration, checked as data (a NaN coefficient would poison every later loss, a negative
    cursor never reaches a prompt): one line naming the snapshot and the field."""
    import math

    from rlhf_core.snapshot.errors import SnapshotSchemaError

    kl_coef, cursor = meta.get("kl_coef"), meta.get("prompt_cursor")
    if kl_coef is not None and (isinstance(kl_coef, bool) or not isinstance(kl_coef, (int, float))
                                or not math.isfinite(kl_coef) or kl_coef < 0):
        raise SnapshotSchemaError(f"{where}: meta_info.kl_coef: expected a finite number >= 0; found {kl_coef!r:.60}")
    if cursor is not None:
        if not (isinstance(cursor, dict) and set(cursor) == {"epoch", "position"} and all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in cursor.values())):
            raise SnapshotSchemaError(f"{where}: meta_info.prompt_cursor: expected {{epoch, position}} whole numbers "
                                      f">= 0; found {cursor!r:.80}")
        cursor = Cursor(**cursor)
    return (None if kl_coef is None else float(kl_coef)), cursor


class PPOTrainer:
    """Drives PPO/GRPO iterations over worker groups placed on a local or remote Ray."""

    def __init__(self, config: RunConfig, workers, loader, state: TrainerState | None = None,
                 on_stage: Callable[[str], None] | None = None, stage_store: StageStore | None = None,
                 prefetch: "PrefetchSource | None" = None) -> None:
        self.config = config
        self.actor, self.reward = workers["actor"], workers["reward"]
        self.critic, self.reward_model = workers.get("critic"), workers.get("reward_model")
        if config.judge_served:  # the reward workers ask the judge's replicas (verl's reward_router_address)
            self.reward.set_judges(self.reward_model.judge_address())
        self.loader = loader
        self.state = state or TrainerState(kl_coef=config.algorithm.kl_ctrl.kl_coef)
        kl = config.algorithm.kl_ctrl
        self.kl_ctrl = (AdaptiveKLController(self.state.kl_coef, kl.target_kl, kl.horizon)
                        if kl.type == "adaptive" else FixedKLController(self.state.kl_coef))
        self.on_stage = on_stage or (lambda name: None)
        self.on_updated: Callable[[], None] | None = None
        self.stage_store = stage_store
        self.prefetch = prefetch
        self.adopted: list[str] = []
        self.worker_time: dict[str, float] = {}
        self.current_stage = ""
        self.side_metrics: dict = {}  # the iteration's side stages' metrics (validation)
        self._val_loader = None
        self._reward_model_identity: dict | None = None
        self._teacher_identity: dict | None = None
        self._starting_model: dict | None = None
        # rollout.mode=async: replicas behind one manager, the actor's ranks or a pool of their own
        self.replicas = workers.get("rollout")  # a rollout pool of its own (rollout.nnodes > 0)
        self._weight_group = None  # its weight group's address, once opened
        self.rollout_manager = None
        if config.rollout.mode == "async":
            shape = ((config.rollout.tensor_model_parallel_size, False) if self.replicas is not None
                     else engine_class(config.rollout.name).replica_shape(config))
            world = config.rollout.own_pool_world_size or config.actor.world_size
            self.rollout_manager = RolloutManager(replicas_of(world, *shape),
                                                  RayReplicaTransport(self.replicas or self.actor))
        self.generation_metrics: dict = {}  # measured by the manager: timing, not data
        self._agent = None  # (context, loops) of the agent loops, once built
        self.rollouter = None  # async_training: the batches of the coming steps, generated ahead
        self.weight_versions: list[int] = []  # the last iteration's rows' weight versions
        #: the weight version the actor holds when it is not the iteration's own (a replay of a
        #: batch generated ahead loads the weights that generated it)
        self.policy_version: int | None = None
        self.gen_batches: dict[int, DataProto] = {}  # a replayed filter_groups' further batches
        self._resuming_gen_batches = False
        #: a replay's recorded further batches of filter_groups (generation -> batch): their
        #: tools' and judge's answers are given again; a batch past the record is generated
        #: live once ``unrecorded_gen_batch(generation)`` returns (it raises to refuse)
        self.replayed_gen_batches: dict[int, DataProto] | None = None
        self.unrecorded_gen_batch: Callable[[int], None] | None = None

    def stages(self) -> list[stage_table.Stage]:
        """This run's stages in order (the table is ``rlhf_core.trainer.stages``)."""
        return stage_table.plan(self.config)

    def run_stages(self, batch: DataProto, stages, notify: bool = True
                   ) -> Iterator[tuple[stage_table.Stage, DataProto, float]]:
        """Run ``stages`` in order from ``batch``, yielding (stage, its output, seconds) after
        each: the one loop over stages that iterations, computing ahead, the redo of
        updates and replay share; what happens between two stages is the caller's.
        ``notify=False``: no ``on_stage`` call (a redo of an earlier iteration's updates is
        not the current iteration's stage)."""
        for stage in stages:
            if notify:
                self.on_stage(stage.name)
            self.current_stage = stage.name  # the stage methods file their metrics and times under it
            t0 = time.perf_counter()
            batch = getattr(self, stage.method)(batch)
            yield stage, batch, time.perf_counter() - t0

    def run_iteration(self) -> dict:
        """One iteration: prompts -> every stage in order -> metrics. With a stage store,
        stages whose output is already committed are loaded instead of recomputed (the
        stateful update stages always re-run: the caller restores their starting state)."""
        iteration = self.state.global_step
        timing: dict[str, float] = {}
        self.worker_time = {}
        t_start = time.perf_counter()
        self.generation_metrics = {}
        batch = self.first_batch()
        plan = self.stages()
        done = self._committed_prefix(iteration, plan)
        # taken even when resuming: no computed-ahead stage may still run into the updates
        ahead = self.prefetch.take(self.state) if self.prefetch is not None else None
        self.adopted = []  # the stages computed ahead and adopted
        self.side_metrics = self._run_side_stages(iteration, timing)
        if done:
            batch = self.stage_store.load(iteration, done[-1].name)  # the whole batch (deltas composed)
            kl_coef, cursor = resumed_state(batch.meta_info, self.stage_store.stage_uri(iteration, done[-1].name))
            if kl_coef is not None:
                self.kl_ctrl.value = kl_coef
            if cursor is not None:  # prompts filter_groups already drew stay drawn
                self.loader.cursor = cursor
        elif ahead is not None:
            batch = self._adopt(iteration, ahead, timing)
            done = plan[:len(ahead.stages)]
            self.adopted = [stage.name for stage in done]
        last_update = [stage for stage in plan if stage.stateful][-1:]
        for stage, batch, seconds in self.run_stages(batch, plan[len(done):]):
            self._stage_done(stage.name)
            if self.stage_store is not None and stage.persisted:
                self.stage_store.save(iteration, stage.name, batch)
            timing[stage.name] = seconds
            if [stage] == last_update and self.on_updated is not None:
                self.on_updated()  # the weights are final for this iteration (a checkpoint may start)

        if "weight_version" in batch.batch.keys():  # which weights generated the rows (async: older ones)
            from rlhf_core.agent.batch import generated_versions

            self.weight_versions = sorted(generated_versions(batch.batch["weight_version"]))
        self.state.global_step += 1
        self.state.cursor = self.loader.cursor.to_dict()
        self.state.kl_coef = self.kl_ctrl.value
        return self._metrics(batch, timing, time.perf_counter() - t_start)

    def _run_side_stages(self, iteration: int, timing: dict) -> dict:
        """The side stages due at this iteration (validation), before the training stages:
        each on a batch of its own, committed as a snapshot of its own (loaded when a
        resumed iteration has it); returns their metrics."""
        metrics = {}
        for stage in stage_table.side_plan(self.config, iteration):
            if self.stage_store is not None and self.stage_store.has(iteration, stage.name):
                out = self.stage_store.load(iteration, stage.name, standalone=True)
            else:
                [(_, out, timing[stage.name])] = self.run_stages(self.side_input(iteration, stage.name), [stage])
                self._stage_done(stage.name)
                if self.stage_store is not None:
                    self.stage_store.save(iteration, stage.name, out, standalone=True)
            metrics.update((out.meta_info.get("stage_metrics") or {}).get(stage.name, {}))
        return metrics

    def side_input(self, iteration: int, name: str) -> DataProto:
        """A side stage's input: every validation prompt (its own loader: the training
        data cursor never moves)."""
        if self._val_loader is None:
            from rlhf_core.trainer.loaders import make_val_loader

            self._val_loader = make_val_loader(self.config)
        from rlhf_core.data.dataset import Cursor

        self._val_loader.cursor = Cursor()  # the same uids at every validation (and in a replay)
        batch = self._val_loader.next_batch()  # the whole set, in file order
        batch.meta_info.update(global_step=iteration)
        return batch

    def _committed_prefix(self, iteration: int, plan: list[stage_table.Stage]) -> list[stage_table.Stage]:
        """The leading stages whose outputs are committed and need not run again (a
        stateful stage always re-runs: the caller restored the state it starts from)."""
        if self.stage_store is None:
            return []
        done = []
        for stage in plan:
            if stage.stateful or not stage.persisted or not self.stage_store.has(iteration, stage.name):
                break
            done.append(stage)
        return done

    def first_batch(self) -> DataProto:
        """The iteration's prompts (advances the data cursor)."""
        batch = self.loader.next_batch()
        batch.meta_info.update(global_step=self.state.global_step, temperature=self.config.rollout.temperature)
        if self.config.algorithm.filter_groups.enable:  # where filter_groups draws its next prompts from
            batch.meta_info["prompt_cursor"] = self.loader.cursor.to_dict()
        return batch

    def _stage_done(self, name: str) -> None:
        """A stage's work is done: the previous stage's snapshot, written in the background
        while this stage ran, is committed now, so at most the last stage's snapshot is
        ever in flight (a crash here loses only this stage's: never an expensive rollout
        whose next stage was short)."""
        if self.stage_store is not None:
            self.stage_store.flush()
        probes.reached(f"stage:{name}")

    def _adopt(self, iteration: int, ahead, timing: dict) -> DataProto:
        """Take the session's computed-ahead stages as this iteration's: their snapshots are
        committed here (under the caller's lease), exactly as if the stages had run now."""
        for name, snapshot in ahead.snapshots():
            self._stage_done(name)  # the same crash points as a stage run here
            if self.stage_store is not None and stage_table.BY_NAME[name].persisted:
                self.stage_store.save(iteration, name, snapshot)
        timing.update(ahead.timing)
        self.worker_time.update(ahead.worker_time)
        return ahead.batch

    # ---------------------------------------------------------------- the stages

    def rollout(self, batch: DataProto) -> DataProto:
        cfg, step = self.config, batch.meta_info["global_step"]
        batch, prompts = seeded_prompts(batch, cfg)
        prompts = self._with_chat(prompts, batch)
        if self.rollouter is not None:  # generated ahead on the rollout pool (async_training)
            batch = batch.union(self._take_generated(prompts, step))
        else:
            batch = batch.union(self.generate_sequences(prompts, step))
        if cfg.trainer.balance_batch and cfg.actor.world_size > 1:  # each rank's chunk: about the same tokens
            batch.reorder(modeling.balanced_order(batch.batch["attention_mask"].sum(dim=1).tolist(),
                                                  cfg.actor.world_size))
        return batch

    def _take_generated(self, prompts: DataProto, step: int) -> DataProto:
        """This step's batch from the rollouter (waiting for it when it is not done), as
        ``generate_sequences`` would give it; the fully-async metrics (verl's names) are
        measurements of this run's timing, kept beside the batch, not in it."""
        generated, waited, queued = self.rollouter.take(step)
        if not all(torch.equal(generated.prompts.batch[key], prompts.batch[key]) for key in ("input_ids", "sample_seed")):
            raise RuntimeError(f"rollout: the batch generated ahead for step {step} holds other prompts or seeds "
                               f"than the step's own (the rollouter's data cursor and the trainer's disagree)")
        out = generated.out
        staleness = (step - out.batch["weight_version"]).float()
        self.generation_metrics.update(generated.timing)  # the background calls' timing
        self.generation_metrics.update({
            "fully_async/trainer/wait_s": waited, "fully_async/queue/steps_ready": float(queued),
            "fully_async/staleness/mean": float(staleness.mean()), "fully_async/staleness/max": float(staleness.max()),
            "fully_async/count/stale_samples": float((staleness > 0).sum()), **self.rollouter.metrics()})
        self.worker_time[self.current_stage] = waited
        return out

    def start_rollouter(self, until_step: int) -> None:
        """async_training: start generating the batches of steps up to ``until_step``
        (exclusive) from the current step, after the one whose rollout is committed; the
        replicas get the trainer's weights first when they hold others."""
        from rlhf_core.trainer.rollouter import Rollouter

        cfg, step = self.config, self.state.global_step
        if not cfg.async_training.enable or step >= until_step:
            return
        loader = self.loader.at(Cursor(**self.state.cursor))  # a reader of its own, at this step's cursor
        first = step
        if self.stage_store is not None and self.stage_store.has(step, "rollout"):
            loader.next_batch()  # this step's batch is committed: it is never generated again
            first += 1

        def prompts_of(j: int) -> DataProto:
            batch = loader.next_batch()
            batch.meta_info.update(global_step=j, temperature=cfg.rollout.temperature)
            batch, prompts = seeded_prompts(batch, cfg)
            return self._with_chat(prompts, batch)

        if any(v != step for v in self.replicas.held_version()):
            self._send_weights(step)
        self.rollouter = Rollouter(cfg, prompts_of, self._generate_ahead, first, until_step, version=step).start()

    def _generate_ahead(self, prompts: DataProto, version: int) -> tuple[DataProto, dict]:
        """The rollouter's call (its thread): the rollout's columns for one step's prompt
        rows on the pool's weights of ``version`` (each row through its agent loop with
        multi_turn), and the generation's timing."""
        sampling = sampling_of(prompts, self.config.rollout)
        timing: dict = {}

        def generate_round(requests: list) -> tuple[list, list]:
            completions, versions, stats = self.rollout_manager.generate(requests, sampling, version=version)
            for key, value in stats.metrics().items():  # summed over an agent's rounds
                timing[key] = timing.get(key, 0.0) + value if key.endswith("/requests") or key == "timing_s/gen" \
                    else value
            timing["pad_id"] = stats.pad_id
            return completions, versions

        if self.config.rollout.multi_turn.enable:
            out, metrics = self._agent_batch(prompts, generate_round)
            out.meta_info.setdefault("stage_metrics", {})["rollout"] = metrics  # from the data: replayed too
        else:
            completions, versions = generate_round(requests_of(prompts))
            out = responses_of(prompts, completions, self.config.rollout.response_length, timing["pad_id"])
            out.batch["weight_version"] = torch.tensor(versions, dtype=torch.long)
        timing.pop("pad_id", None)
        return out, timing

    def stop_rollouter(self) -> None:
        """Stop generating ahead: what was generated and not taken is dropped (a resumed run
        generates it again from the same prompts and seeds)."""
        if self.rollouter is not None:
            self.rollouter.stop()
            self.rollouter = None

    def generate_sequences(self, prompts: DataProto, step: int) -> DataProto:
        """The one generation call site (training rollouts, DAPO's further batches,
        ReMax's greedy baseline, validation): the rollout's columns for left-padded prompt
        rows with a ``sample_seed`` each, plus ``weight_version``, the trainer step whose
        weights generated each row (``step``: every row's, here where the rollout waits for
        the update). ``rollout.mode=sync``: each actor rank its static share, one call;
        ``async``: requests balanced over the replicas by the manager."""
        if self.config.rollout.multi_turn.enable:  # every row through its agent loop, each turn a request
            return self._agent_rollout(prompts, step)
        if self.rollout_manager is None:
            return self._take(self.actor.generate_sequences(prompts))
        completions, versions, pad_id = self._generate_requests(requests_of(prompts), prompts, step)
        out = responses_of(prompts, completions, self.config.rollout.response_length, pad_id)
        out.batch["weight_version"] = torch.tensor(versions, dtype=torch.long)
        return out

    def _generate_requests(self, requests: list, prompts: DataProto, step: int) -> tuple[list, list, int]:
        """Completions of ``requests`` (sampled as ``prompts`` asks), the weight version of
        each and the engines' padding id: through the manager (async), or as one batch
        call of the actor ranks (sync)."""
        if self.rollout_manager is None:
            batch = prompts_of(requests, self._pad_id)
            batch.meta_info = dict(prompts.meta_info)
            out = self._take(self.actor.generate_sequences(batch))
            return completions_of(requests, out), out.batch["weight_version"].tolist(), self._pad_id
        version = step if self.policy_version is None else self.policy_version
        if self.rollouter is not None:
            self.rollouter.pause()  # one caller of the replicas at a time (validation)
        try:
            if self.replicas is not None and any(v != version for v in self.replicas.held_version()):
                self._send_weights(version)  # a first rollout, or after a restore: the trainer's weights first
            completions, versions, stats = self.rollout_manager.generate(
                requests, sampling_of(prompts, self.config.rollout), version=version)
        finally:
            if self.rollouter is not None:
                self.rollouter.resume(version)
        for key, value in stats.metrics().items():  # summed over the calls of a stage (an agent's turns)
            self.generation_metrics[key] = self.generation_metrics.get(key, 0.0) + value \
                if key.endswith("/requests") or key == "timing_s/gen" else value
        self.worker_time[self.current_stage] = self.worker_time.get(self.current_stage, 0.0) + stats.seconds
        return completions, versions, stats.pad_id

    def _agent_rollout(self, prompts: DataProto, step: int) -> DataProto:
        """``rollout.multi_turn.enable``: each row's trajectory through its agent loop
        (rlhf_core/agent/), the turns of the trajectories waiting together sent as one
        call; with ``prompts.meta_info["replay_tool_calls"]`` the recorded answers are
        given instead of calling the tools."""
        out, metrics = self._agent_batch(prompts, lambda requests: self._generate_requests(requests, prompts, step)[:2])
        return self._stage_metrics(out, metrics) if self.current_stage == "rollout" else out

    def _agent_batch(self, prompts: DataProto, generate_round) -> tuple[DataProto, dict]:
        """Every row's trajectory through its agent loop, ``generate_round(requests)``
        answering each round of turns; the batch and the agent metrics."""
        from rlhf_core.agent.batch import run_batch
        from rlhf_core.agent.registry import default_loop

        ctx, loops = self._agents()
        return run_batch(prompts, ctx, loops, default_loop(self.config), generate_round, self._pad_id,
                         replaying="agent/tool_calls" in prompts.non_tensor_batch)

    def _agents(self):
        """The agent context and loops, built once per controller (tools are built once
        and make an instance per trajectory)."""
        if self._agent is None:
            from rlhf_core.agent.registry import build_loops
            from rlhf_core.agent.runner import AgentContext
            from rlhf_core.agent.tool_config import build_tools, load_tool_config

            cfg = self.config
            tokenizer = modeling.load_tokenizer(modeling.resolve_model_path(cfg.model.path, cfg.trainer.seed,
                                                                            weights=False))
            specs = load_tool_config(cfg.rollout.multi_turn.tool_config_path) \
                if cfg.rollout.multi_turn.tool_config_path else []
            eos = tokenizer.eos_token_id
            interactions = None
            if cfg.rollout.multi_turn.interaction_config_path:  # built when first asked (a replay asks none)
                from rlhf_core.agent.interaction_config import build_interactions, load_interaction_config

                chosen = load_interaction_config(cfg.rollout.multi_turn.interaction_config_path)
                interactions = lambda: build_interactions(chosen)  # noqa: E731
            ctx = AgentContext(tokenizer, cfg.rollout.multi_turn, cfg.rollout.response_length,
                               lambda: build_tools(specs), eos_ids=(eos,) if eos is not None else (),
                               schemas=[spec.schema for spec in specs], interactions=interactions)
            self._agent = (ctx, build_loops(cfg.rollout.agent))
        return self._agent

    @property
    def _pad_id(self) -> int:
        return self.loader.tokenizer.pad_token_id or 0

    def _with_chat(self, prompts: DataProto, batch: DataProto) -> DataProto:
        """The prompt rows' chat, tools' arguments and agent names, which an agent loop
        reads (multi-turn only; single-turn prompts are their tokens). In a replay
        (``meta_info[RECORDED_TOOL_CALLS]``: sample seed -> the row's recorded calls), the
        calls each row recorded: their answers are given again, no tool is called."""
        if self.config.rollout.multi_turn.enable:
            for key in ("raw_chat", "raw_prompt", "extra_info", "agent_name"):
                if key in batch.non_tensor_batch:
                    prompts.non_tensor_batch[key] = batch.non_tensor_batch[key]
            recorded = batch.meta_info.pop(RECORDED_TOOL_CALLS, None)
            if recorded is not None:
                prompts.non_tensor_batch["agent/tool_calls"] = np.array(
                    [recorded[int(seed)] for seed in prompts.batch["sample_seed"].tolist()], dtype=object)
        return prompts

    def filter_groups(self, batch: DataProto) -> DataProto:
        """DAPO's dynamic sampling: keep the groups whose filter_groups.metric varies; while
        fewer than data.train_batch_size are kept, generate and score the next batch of
        prompts (the stages before this one) and keep its varied groups too; the first
        train_batch_size groups are the iteration's batch. Each further batch is committed
        whole as it is scored (``gen_batch_snapshot``): a resumed stage takes it from there."""
        cfg, step = self.config, batch.meta_info["global_step"]
        wanted, limit = cfg.data.train_batch_size, cfg.algorithm.filter_groups.max_num_gen_batches
        self.loader.cursor = Cursor(**batch.meta_info["prompt_cursor"])
        self.gen_batches = {}
        self._resuming_gen_batches = self.stage_store is not None  # until one is missing: then none later is
        scored, parts, uids, generations = batch, [], [], 1
        while True:
            keep = varied_groups(scored.non_tensor_batch["uid"].tolist(), self._group_metric(scored))
            uids += keep[:wanted - len(uids)]
            kept = set(keep)
            part = scored.select_idxs(torch.tensor(
                [row for row, uid in enumerate(scored.non_tensor_batch["uid"].tolist()) if uid in kept],
                dtype=torch.long))
            part.meta_info = {}  # each generation batch's own (the first batch's is the output's)
            parts.append(part)
            if len(uids) >= wanted:
                break
            if limit and generations >= limit:
                raise RuntimeError(f"algorithm.filter_groups.max_num_gen_batches={limit}: {len(uids)} of {wanted} "
                                   f"groups with a varied {cfg.algorithm.filter_groups.metric} after {generations} "
                                   f"generation batches (0: no limit)")
            scored = self._gen_batch(step, generations)
            generations += 1
        chosen = set(uids)
        columns = {key for part in parts for key in part.non_tensor_batch}
        for part in parts:  # a reward function may return a key for some batches only
            for key in columns - set(part.non_tensor_batch):
                part.non_tensor_batch[key] = np.array([None] * len(part), dtype=object)
        out = DataProto.concat(parts)
        out = out.select_idxs(torch.tensor([row for row, uid in enumerate(out.non_tensor_batch["uid"].tolist())
                                            if uid in chosen], dtype=torch.long))
        if cfg.trainer.balance_batch and cfg.actor.world_size > 1:
            out.reorder(modeling.balanced_order(out.batch["attention_mask"].sum(dim=1).tolist(), cfg.actor.world_size))
        out.meta_info = {**batch.meta_info, "prompt_cursor": self.loader.cursor.to_dict()}
        return self._stage_metrics(out, {"train/num_gen_batches": generations})

    def _group_metric(self, batch: DataProto) -> list[float]:
        metric = self.config.algorithm.filter_groups.metric
        if metric in ("seq_reward", "seq_final_reward"):  # no KL penalty before the advantage here
            return batch.batch["token_level_scores"].sum(dim=-1).tolist()
        column = batch.non_tensor_batch.get(f"reward_extra/{metric}")
        if column is None or any(v is None for v in column.tolist()):
            found = sorted(k[len("reward_extra/"):] for k in batch.non_tensor_batch if k.startswith("reward_extra/"))
            raise RuntimeError(f"algorithm.filter_groups.metric={metric}: expected seq_reward, seq_final_reward or "
                               f"a key the reward function returns for every response; it returns {found}")
        return [float(v) for v in column.tolist()]

    def _gen_batch(self, step: int, generation: int) -> DataProto:
        """filter_groups' further generation batch ``generation``: the committed one when a
        killed stage resumes (no tool, judge or model is asked again, the data cursor moves
        past its prompts), else generated, scored and committed."""
        name, store = stage_table.gen_batch_snapshot(generation), self.stage_store
        # committed in order: once one is missing, asking again would only wait for the last write
        self._resuming_gen_batches = self._resuming_gen_batches and store.has(step, name)
        if self._resuming_gen_batches:
            scored = store.load(step, name, standalone=True)
            where = store.stage_uri(step, name)
            _, cursor = resumed_state(scored.meta_info, where)
            if cursor is None or scored.meta_info.get("generation") != generation:
                from rlhf_core.snapshot.errors import SnapshotSchemaError

                raise SnapshotSchemaError(f"{where}: meta_info: expected generation {generation} and the "
                                          f"prompt_cursor after it; found {str(scored.meta_info)[:80]!r}")
            self.loader.cursor = cursor
        else:
            scored = self._generate_scored(step, generation)
            scored.meta_info["prompt_cursor"] = self.loader.cursor.to_dict()
            self._stage_done(name)
            if store is not None:
                store.save(step, name, scored, standalone=True)
        if self.replayed_gen_batches is not None:  # a replay compares them with their record
            self.gen_batches[generation] = scored
        return scored

    def _generate_scored(self, step: int, generation: int) -> DataProto:
        """The next generation batch, through the stages before filter_groups. In a replay
        (``replayed_gen_batches``), with the answers its record holds: its tools' and its
        judge's answers are given again, none is asked."""
        batch = self.loader.next_batch()
        batch.meta_info.update(global_step=step, temperature=self.config.rollout.temperature, generation=generation)
        recorded = self.replayed_gen_batches.get(generation) if self.replayed_gen_batches is not None else None
        if self.replayed_gen_batches is not None and recorded is None and self.unrecorded_gen_batch is not None:
            self.unrecorded_gen_batch(generation)  # a replay's: past the record, may it be generated?
        if recorded is not None and self.config.rollout.multi_turn.enable:
            from rlhf_core.agent.batch import recorded_calls

            calls = recorded_calls(recorded.non_tensor_batch)
            if calls is not None:
                batch.meta_info[RECORDED_TOOL_CALLS] = calls
        for stage in self.stages():
            if stage.name == "filter_groups":
                break
            if stage.name == stage_table.SCORED and recorded is not None and JUDGE_CALLS in recorded.non_tensor_batch:
                # row by row: the recorded answers are to the recorded responses only
                if not torch.equal(batch.batch["responses"], recorded.batch["responses"]):
                    raise RuntimeError(f"generation batch {generation} of filter_groups: expected the responses its "
                                       f"record holds (the judge's recorded answers are to those); the rollout "
                                       f"generated others (compare its rollout first)")
                batch.non_tensor_batch[JUDGE_CALLS] = recorded.non_tensor_batch[JUDGE_CALLS]
            batch = getattr(self, stage.method)(batch)
        return batch

    def compute_reward_baseline(self, batch: DataProto) -> DataProto:
        """ReMax's baseline: each prompt's greedy response, scored by the reward function,
        given to every row of the prompt as ``reward_baselines``."""
        uids = batch.non_tensor_batch["uid"]
        first = {}
        for row, uid in enumerate(uids.tolist()):
            first.setdefault(uid, row)
        rows = list(first.values())
        prompt_len = batch.batch["prompts"].shape[1]
        greedy_in = DataProto.from_dict({
            "input_ids": batch.batch["prompts"][rows],
            "attention_mask": batch.batch["attention_mask"][rows, :prompt_len],
            "sample_seed": torch.zeros(len(rows), dtype=torch.long)}, meta_info={"do_sample": False})
        greedy = self.generate_sequences(greedy_in, batch.meta_info["global_step"])
        for key in ("uid", "data_source", "ground_truth", "extra_info"):
            if key in batch.non_tensor_batch:
                greedy.non_tensor_batch[key] = batch.non_tensor_batch[key][rows]
        scored = self._scored(greedy.select(["responses", "response_mask", "attention_mask"],
                                            ["uid", "data_source", "ground_truth", "extra_info"]))
        by_uid = dict(zip(uids[rows].tolist(), scored.batch["token_level_scores"].sum(dim=-1).tolist()))
        batch.batch["reward_baselines"] = torch.tensor([by_uid[u] for u in uids.tolist()], dtype=torch.float32)
        return batch

    def validate(self, batch: DataProto) -> DataProto:
        """rollout.val_kwargs responses (greedy by default) to the validation prompts on the
        weights the iteration starts from, scored by the run's reward; metrics under
        verl's names (``val-core/<data_source>/reward/mean@1``). Seeded by val_kwargs.seed,
        so the training's draws are untouched."""
        val, step = self.config.rollout.val_kwargs, batch.meta_info["global_step"]
        recorded = batch.meta_info.pop(RECORDED_JUDGE_CALLS, None)  # a replay's: no judge is asked again
        batch = batch.repeat(val.n, interleave=True)
        batch.batch["sample_seed"] = val.seed + step * 1_000_003 + torch.arange(len(batch))
        prompts = self._with_chat(batch.pop(batch_keys=["input_ids", "attention_mask", "position_ids",
                                                        "sample_seed"]), batch)
        prompts.meta_info = {"do_sample": val.do_sample and val.temperature > 0,
                             "sampling": {"temperature": val.temperature, "top_p": val.top_p,
                                          "top_k": val.top_k}}
        batch = batch.union(self.generate_sequences(prompts, step))
        if recorded is not None:
            if len(recorded) != len(batch):
                raise ValueError(f"{RECORDED_JUDGE_CALLS}: expected one recorded judge record per validation "
                                 f"response ({len(batch)}); found {len(recorded)}")
            batch.non_tensor_batch[JUDGE_CALLS] = np.array(recorded, dtype=object)
        if self.reward_model is not None and not self.config.judge_served:  # scored as training is (verl's rule)
            batch = self.compute_rm_score(batch)
        batch = self.compute_reward(batch)
        nt = batch.non_tensor_batch
        variables = {"reward": batch.batch["token_level_scores"].sum(dim=-1).tolist()}
        for key in nt:
            values = nt[key].tolist() if key.startswith("reward_extra/") else []
            if values and (all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
                           or key == "reward_extra/pred"):  # the answers maj@k votes on
                variables[key[len("reward_extra/"):]] = values
        return self._stage_metrics(batch, validation_metrics(nt["data_source"].tolist(), nt["uid"].tolist(),
                                                             variables))

    def starting_model_identity(self) -> dict:
        """The policy's starting model: its configured path and content hashes (rank 0's
        actor answers); asked once per controller."""
        if self._starting_model is None:
            self._starting_model = dict(self.actor.starting_model()[0])
        return self._starting_model

    def reward_model_identity(self) -> dict | None:
        """The reward model's path and content hash (rank 0's: the one that read the
        weights), or None without one; asked once."""
        if self.reward_model is None:
            return None
        if self._reward_model_identity is None:
            self._reward_model_identity = dict(self.reward_model.identity()[0])
        return self._reward_model_identity

    def compute_rm_score(self, batch: DataProto) -> DataProto:
        """The reward model's score of each response (``rm_scores``, at its last token)."""
        chat = [key for key in ("raw_prompt", "raw_chat") if key in batch.non_tensor_batch]
        return batch.union(self._take(self.reward_model.compute_rm_score(
            batch.select(SEQUENCE_KEYS + ["response_mask"], chat))))

    def compute_reward(self, batch: DataProto) -> DataProto:
        scored = ["rm_scores"] if "rm_scores" in batch.batch.keys() else []
        # a replay's recorded judge answers go with their rows (and come back as they were)
        recorded = [JUDGE_CALLS] if JUDGE_CALLS in batch.non_tensor_batch else []
        needed = batch.select(["responses", "response_mask", "attention_mask"] + scored,
                              ["uid", "data_source", "ground_truth", "extra_info"] + recorded)
        if recorded:
            batch.non_tensor_batch.pop(JUDGE_CALLS)
        return batch.union(self._scored(needed))

    def _scored(self, rows: DataProto) -> DataProto:
        """The reward worker's scores of ``rows``; a served judge is awake meanwhile (its
        memory is the actor's while the actor trains)."""
        if not self.config.judge_served:
            return self._take(self.reward.compute_reward(rows))
        self.reward_model.judge_wake()
        try:
            return self._take(self.reward.compute_reward(rows))
        finally:
            self.reward_model.judge_sleep()

    def compute_old_log_prob(self, batch: DataProto) -> DataProto:
        out = self.actor.compute_log_prob(batch.select(SEQUENCE_KEYS, []))
        return batch.union(self._take(out))

    def compute_ref_log_prob(self, batch: DataProto) -> DataProto:
        out = self.actor.compute_ref_log_prob(batch.select(SEQUENCE_KEYS, []))
        return batch.union(self._take(out))

    def compute_teacher_log_prob(self, batch: DataProto) -> DataProto:
        """The distillation teacher's log-prob of each sampled token (``teacher_log_prob``)."""
        out = self.actor.compute_teacher_log_prob(batch.select(SEQUENCE_KEYS, []))
        return batch.union(self._take(out))

    def teacher_identity(self) -> dict | None:
        """The distillation teacher's path and content hash (rank 0's), or None without
        one; asked once."""
        if not self.config.distillation.enabled:
            return None
        if self._teacher_identity is None:
            self._teacher_identity = dict(self.actor.teacher_identity()[0])
        return self._teacher_identity

    def compute_values(self, batch: DataProto) -> DataProto:
        out = self.critic.compute_values(batch.select(SEQUENCE_KEYS + ["response_mask"], []))
        return batch.union(self._take(out))

    def compute_advantage(self, batch: DataProto) -> DataProto:
        cfg = self.config.algorithm
        mask = batch.batch["response_mask"].float()
        rewards = batch.batch["token_level_scores"]
        metrics: dict[str, float] = {}
        if cfg.use_kl_in_reward:
            rewards, current_kl = apply_kl_penalty(rewards, batch.batch[self.config.old_log_prob_column],
                                                   batch.batch["ref_log_prob"],
                                                   mask, self.kl_ctrl.value, cfg.kl_penalty)
            metrics.update({"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": self.kl_ctrl.value})
            self.kl_ctrl.update(current_kl, n_steps=len(batch))
        batch.meta_info["kl_coef"] = self.kl_ctrl.value
        correction = cfg.rollout_correction
        if correction.active and not correction.bypass_mode:  # verl: after the KL penalty, before the advantages
            mask, weights, corrected = rollout_correction.correct(
                batch.batch["old_log_probs"] - batch.batch["rollout_log_probs"], mask, correction)
            batch.batch["response_mask"] = mask.to(batch.batch["response_mask"].dtype)
            if weights is not None:
                batch.batch["rollout_is_weights"] = weights
            metrics.update(corrected)
        # every estimator gets the same named inputs (absent ones None): see AdvEstimatorSpec
        columns = batch.batch
        advantages, returns = get_adv_estimator_fn(cfg.adv_estimator)(
            token_level_rewards=rewards, response_mask=mask, values=columns.get("values", None),
            index=batch.non_tensor_batch["uid"], reward_baselines=columns.get("reward_baselines", None),
            gamma=cfg.gamma, lam=cfg.lam, norm_adv_by_std_in_grpo=cfg.norm_adv_by_std_in_grpo,
            old_log_probs=columns.get("old_log_probs", None), sum_pi_squared=columns.get("sum_pi_squared", None),
            rollout_is_weights=columns.get("rollout_is_weights", None))
        # the teacher's per-token signal on the advantages (a top-k loss is the actor's own)
        if self.config.distillation.enabled and not self.config.distillation.topk_width:
            advantages, distilled = self._distilled(batch, advantages, mask)
            metrics.update(distilled)
        batch.batch["token_level_rewards"] = rewards
        batch.batch["advantages"], batch.batch["returns"] = advantages, returns
        if cfg.use_pf_ppo:  # PF-PPO: the updates see the rows drawn again by their scores
            batch = self._pf_ppo_resample(batch)
        return self._stage_metrics(batch, metrics) if metrics else batch

    def _distilled(self, batch: DataProto, advantages: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The advantages with the teacher's per-token KL (``rlhf_core.algorithms.distillation``),
        measured against the log-probs the student sampled with (the old_log_prob stage's
        when it runs, else the rollout engine's)."""
        from rlhf_core.algorithms.distillation import distillation_kl, distillation_metrics, distilled_advantages

        loss = self.config.distillation.distillation_loss
        columns = batch.batch
        student = columns["old_log_probs"] if "old_log_probs" in columns.keys() else columns["rollout_log_probs"]
        kl = distillation_kl(student, columns["teacher_log_prob"], mask, loss.loss_mode, loss.log_prob_min_clamp,
                             loss.loss_max_clamp)
        return (distilled_advantages(advantages, kl, mask, loss.use_task_rewards, loss.distillation_loss_coef),
                distillation_metrics(kl, mask))

    def _pf_ppo_resample(self, batch: DataProto) -> DataProto:
        """As many rows as the batch, drawn with replacement by ``pf_ppo_weights`` of their
        scores; seeded by the run's seed and step, so a replay draws the same rows."""
        cfg = self.config.algorithm.pf_ppo
        weights = pf_ppo_weights(batch.batch["token_level_scores"].sum(dim=-1), cfg.reweight_method, cfg.weight_pow)
        draw = torch.Generator().manual_seed(self.config.trainer.seed * 1_000_003 + batch.meta_info["global_step"])
        return batch.select_idxs(torch.multinomial(weights, len(batch), replacement=True, generator=draw))

    def update_critic(self, batch: DataProto) -> DataProto:
        needed = batch.select(SEQUENCE_KEYS + ["response_mask", "values", "returns"], [], ["global_step"])
        out = self._take(self.critic.update_critic(needed))
        return self._stage_metrics(batch, reduce_metrics(out.meta_info["metrics"]))

    def update_actor(self, batch: DataProto) -> DataProto:
        if batch.meta_info["global_step"] + 1 < self.config.trainer.critic_warmup:  # verl counts steps from 1
            return self._stage_metrics(batch, {})  # critic warmup: the actor's weights stay
        old = self.config.old_log_prob_column  # None: the update's own forward
        keys = SEQUENCE_KEYS + ["response_mask", "advantages"] + ([old] if old else [])
        keys += ["ref_log_prob"] if self.config.actor.use_kl_loss else []
        keys += ["rollout_is_weights"] if "rollout_is_weights" in batch.batch.keys() else []
        keys += ["teacher_topk_log_probs", "teacher_topk_ids"] if self.config.distillation.topk_width else []
        needed = batch.select(keys, [], ["global_step"])
        if old and old != "old_log_probs":
            needed = needed.rename(old, "old_log_probs")
        out = self._take(self.actor.update_actor(needed))
        return self._stage_metrics(batch, reduce_metrics(out.meta_info["metrics"]))

    def weight_sync(self, batch: DataProto) -> DataProto:
        """The updated weights to the rollout engines, as version ``global_step + 1``: in
        place on the actor's ranks, or through the checkpoint engine to a pool of their own
        (async_training: every trigger_parameter_sync_step steps, the rollouter paused for it)."""
        version = batch.meta_info["global_step"] + 1
        if self.config.async_training.enable:
            if self.rollouter is None or version % self.config.async_training.trigger_parameter_sync_step:
                # no sync at this step (a redo on restore: the rollouter's start sends the weights)
                return self._stage_metrics(batch, {"fully_async/weight_synced": 0.0})
            self.rollouter.pause()
            synced = self._send_weights(version)  # a failure raises: the rollouter stays paused
            self.rollouter.resume(version)
        elif self.replicas is not None:
            synced = self._send_weights(version)
        else:
            synced = self.actor.sync_weights(version)
        self.worker_time[self.current_stage] = max(s["seconds"] for s in synced)
        return self._stage_metrics(batch, {
            "perf/weight_sync_peak_gathered_mib": max(s["peak_gathered_bytes"] for s in synced) / 2**20,
            "perf/weight_sync_bytes": float(max(s["bytes"] for s in synced)),
            "training/weight_version": float(synced[0]["version"]),
            **({"fully_async/weight_synced": 1.0} if self.config.async_training.enable else {})})

    def _send_weights(self, version: int) -> list[dict]:
        """The checkpoint engine: the actor's ranks gather the policy, its first rank
        broadcasts it in buckets to every replica rank, all at once; returns the actor
        ranks' reports. A transfer that fails raises: no replica holds the version then."""
        from rlhf_core.controller.worker_group import ray_get_ranked

        size = 1 + self.replicas.world_size
        if self._weight_group is None:
            self._weight_group = self.actor.open_weight_group(size)[0]
        host, port = self._weight_group
        senders = [self.actor.submit_to_rank(r, "send_weights", version) for r in range(self.actor.world_size)]
        receivers = [self.replicas.submit_to_rank(r, "receive_weights", host, port, 1, size)
                     for r in range(self.replicas.world_size)]
        # one wait over both sides: the first failure raises at once (the others wait in the broadcast)
        return ray_get_ranked(senders + receivers, "actor -> rollout", "send_weights / receive_weights")[
            :len(senders)]

    # ---------------------------------------------------------------- helpers

    def _take(self, out: DataProto) -> DataProto:
        """Strip the workers' self-reported compute time (a measurement, never data), kept
        as the running stage's worker time."""
        metrics = out.meta_info.get("metrics") or {}
        spent = metrics.pop("timing_worker_s", None)
        if spent:
            spent = max(spent) if isinstance(spent, list) else spent  # summed over a stage's calls (agent turns)
            self.worker_time[self.current_stage] = self.worker_time.get(self.current_stage, 0.0) + spent
        if not metrics:
            out.meta_info.pop("metrics", None)
        return out

    def _stage_metrics(self, batch: DataProto, metrics: dict) -> DataProto:
        """The running stage's metrics, kept in the batch (a resumed iteration has them)."""
        batch.meta_info.setdefault("stage_metrics", {})[self.current_stage] = metrics
        return batch

    def _metrics(self, batch: DataProto, timing: dict, total: float) -> dict:
        metrics = {}
        for stage_metrics in (batch.meta_info.get("stage_metrics") or {}).values():
            metrics.update(stage_metrics)
        entropys = batch.batch["entropys"] if "entropys" in batch.batch.keys() else None
        metrics.update(compute_data_metrics(batch, entropys, use_critic=self.config.use_critic))
        metrics.update({f"timing_s/{k}": v for k, v in timing.items()})
        metrics.update({f"timing_worker_s/{k}": v for k, v in self.worker_time.items()})
        metrics["timing_s/iteration"] = total
        if self.prefetch is not None:
            metrics["perf/prefetch_adopted"] = float(bool(self.adopted))
        inside = sum(self.worker_time.values())
        metrics["perf/worker_time_s"] = inside
        metrics["perf/outside_workers_share"] = max(0.0, 1 - inside / total) if inside else 0.0
        tokens = int(batch.batch["attention_mask"].sum())
        metrics["perf/total_num_tokens"] = tokens
        metrics["perf/throughput"] = tokens / total
        metrics["training/global_step"] = self.state.global_step
        metrics.update(self.side_metrics)
        metrics.update(self.generation_metrics)
        return metrics
