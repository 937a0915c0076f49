"""Generation as a service: the engine registry and protocol, the manager balancing
requests over replicas (a slow replica, a dying replica, a pinned weight version), and
the actor's replica side (versions, a failed weight sync)."""

import heapq
import os
from types import SimpleNamespace

import pytest
import torch

from rlhf_core.rollout import GenerationRequest, Sampling, engine_class, engine_names
from rlhf_core.rollout.manager import (
    Answer, Replica, ReplicaDiedError, RolloutManager, WeightVersionError, plan_chunks, prompt_groups, replicas_of,
)
from rlhf_core.rollout.engine import Completion

SAMPLING = Sampling(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=8)


def _answer_of(request: GenerationRequest) -> Completion:
    """A deterministic 'engine': the response is a function of the request's seed alone
    (as a per-request-seeded engine's), 1 to 8 tokens long."""
    length = 1 + request.seed % 8
    return Completion(request.request_id, [request.seed % 50 + i for i in range(length)], [-0.1 * i for i in range(length)])


def _requests(prompts: int = 12, n: int = 4) -> list[GenerationRequest]:
    return [GenerationRequest(f"r{p * n + i}", (p, p + 1, p + 2), 1000 + p * n + i) for p in range(prompts) for i in range(n)]


class SimulatedTransport:
    """Replicas on a simulated clock (no sleeping): each replica serves its calls in order,
    a request taking ``cost`` x its response length; ``wait_any`` returns the call that
    finishes first. ``dies``: replica index -> the call number at which its process dies."""

    def __init__(self, speeds: dict[int, float], version: int = 3, dies: dict[int, int] | None = None) -> None:
        self.speeds, self.version, self.dies = speeds, version, dies or {}
        self.free_at = {i: 0.0 for i in speeds}
        self.calls = {i: 0 for i in speeds}
        self.events: list = []
        self.now, self.counter = 0.0, 0

    def submit(self, replica, requests, sampling, version):
        self.calls[replica.index] += 1
        cost = sum(len(_answer_of(r).token_ids) for r in requests) * self.speeds[replica.index]
        start = max(self.now, self.free_at[replica.index])
        self.free_at[replica.index] = start + cost
        self.counter += 1
        # a call at or after the one the process dies in never answers
        died = self.calls[replica.index] >= self.dies.get(replica.index, float("inf"))
        handle = (start + cost, self.counter, replica.index, died, tuple(requests))
        heapq.heappush(self.events, handle)
        return handle

    def wait_any(self, pending):
        first = min(pending)
        self.events.remove(first)
        self.now = first[0]
        return [first]

    def result(self, handle):
        _, _, index, died, requests = handle
        if died:
            raise ReplicaDiedError(f"replica {index} died")
        return Answer([_answer_of(r) for r in requests], self.version, 0.0, pad_id=0)


def test_chunks_keep_a_prompts_samples_together_in_order():
    requests = _requests(prompts=5, n=3)
    assert prompt_groups(requests) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11], [12, 13, 14]]
    chunks = plan_chunks(requests, 3)
    assert [i for c in chunks for i in c] == list(range(15))  # every request once, in order
    assert all(len(c) % 3 == 0 for c in chunks) and len(chunks) == 3
    assert plan_chunks(requests, 50) == prompt_groups(requests)  # never a group split
    assert replicas_of(4, 2) == [Replica(0, [0, 1]), Replica(1, [2, 3])]
    assert replicas_of(3, 3, splits=True) == [Replica(0, [0, 1, 2], splits=True)]


def test_a_slow_replica_gets_fewer_requests_and_the_rows_do_not_depend_on_who_served_them():
    requests = _requests()
    alone, versions, _ = RolloutManager([Replica(0, [0])], SimulatedTransport({0: 1.0})).generate(
        requests, SAMPLING, version=3)
    transport = SimulatedTransport({0: 1.0, 1: 4.0})  # replica 1 four times slower
    both, versions, stats = RolloutManager([Replica(0, [0]), Replica(1, [1])], transport).generate(
        requests, SAMPLING, version=3)
    assert both == alone and versions == [3] * len(requests)
    assert stats.per_replica[0] > 2 * stats.per_replica[1] > 0  # balanced by what each finished
    assert sum(stats.per_replica.values()) == len(requests)
    # a static half each would end when the slow replica ends its half
    static_end = max(sum(len(_answer_of(r).token_ids) for r in half) * speed
                     for half, speed in ((requests[:24], 1.0), (requests[24:], 4.0)))
    assert transport.now < 0.8 * static_end
    metrics = stats.metrics()
    assert metrics["rollout/replica_0/requests"] == stats.per_replica[0] and metrics["rollout/load_imbalance"] > 1


def test_a_replica_that_dies_mid_iteration_leaves_its_requests_to_the_others():
    requests = _requests()
    replicas = lambda: [Replica(i, [i]) for i in range(3)]
    clean, _, _ = RolloutManager(replicas(), SimulatedTransport({0: 1.0, 1: 1.0, 2: 1.0})).generate(requests, SAMPLING)
    # replica 1 dies on its second call: its chunk in flight then (and the one queued) go to 0 and 2
    out, _, stats = RolloutManager(replicas(), SimulatedTransport({0: 1.0, 1: 1.0, 2: 1.0}, dies={1: 2})).generate(
        requests, SAMPLING)
    assert out == clean and stats.replicas_lost == 1
    assert sum(stats.per_replica.values()) == len(requests)
    with pytest.raises(Exception, match="every one of 1 replicas died"):
        RolloutManager([Replica(0, [0])], SimulatedTransport({0: 1.0}, dies={0: 1})).generate(requests, SAMPLING)


def test_an_answer_from_other_weights_is_refused():
    with pytest.raises(WeightVersionError, match="answered with weight version 2; expected 3"):
        RolloutManager([Replica(0, [0])], SimulatedTransport({0: 1.0}, version=2)).generate(_requests(), SAMPLING,
                                                                                           version=3)


def test_engines_are_the_modules_of_the_registry_and_an_unknown_one_is_refused():
    from rlhf_core.config import ConfigError, RunConfig, apply_overrides
    from rlhf_core.rollout import EngineConfigError

    assert engine_names() == ("hf", "vllm")
    assert engine_class("hf").name == "hf" and engine_class("vllm").name == "vllm"
    with pytest.raises(EngineConfigError, match=r"^rollout.name: expected one of hf, vllm; found 'sglang'$"):
        engine_class("sglang")
    with pytest.raises(ConfigError, match=r"^rollout.name: expected a registered name \(hf, vllm\); found 'sglang'$"):
        apply_overrides(RunConfig(), ["rollout.name=sglang"]).validate()
    # how each engine's ranks form replicas: HF on an FSDP-sharded policy decodes on all
    # ranks together (one replica splitting its calls); vLLM's tensor-parallel groups
    shape = lambda *o: engine_class(apply_overrides(RunConfig(), list(o)).rollout.name).replica_shape(
        apply_overrides(RunConfig(), list(o)))
    assert shape("actor.world_size=4") == (4, True) and shape("actor.world_size=4", "actor.strategy=ddp") == (1, False)
    assert shape("rollout.name=vllm", "rollout.tensor_model_parallel_size=2", "actor.world_size=4") == (2, False)
    with pytest.raises(ConfigError, match=r"^rollout.max_num_batched_tokens: expected at least rollout.max_num_seqs"):
        apply_overrides(RunConfig(), ["rollout.name=vllm", "rollout.max_num_batched_tokens=8"]).validate()
    apply_overrides(RunConfig(), ["rollout.name=hf", "rollout.max_num_batched_tokens=8"]).validate()  # vLLM's rule


def test_a_third_engine_is_one_file(tmp_path, monkeypatch):
    """A module under rollout/engines registering a class is an engine: listed, checked."""
    from rlhf_core.rollout import engines

    folder = tmp_path / "engines"
    folder.mkdir()
    (folder / "echo.py").write_text(
        "from rlhf_core.rollout.engine import Completion, EngineConfigError, RolloutEngine\n"
        "from rlhf_core.rollout.registry import register_engine\n\n\n"
        "@register_engine('echo')\n"
        "class EchoEngine(RolloutEngine):\n"
        "    @classmethod\n"
        "    def check(cls, cfg):\n"
        "        if cfg.rollout.n > 4:\n"
        "            raise EngineConfigError(f'rollout.n: expected at most 4 with rollout.name=echo; found {cfg.rollout.n}')\n\n"
        "    def generate(self, requests, sampling):\n"
        "        return [Completion(r.request_id, list(r.prompt_ids), [0.0] * len(r.prompt_ids)) for r in requests]\n")
    monkeypatch.setattr(engines, "__path__", [*engines.__path__, str(folder)])
    from rlhf_core.config import ConfigError, RunConfig, apply_overrides

    assert "echo" in engine_names()
    echo = engine_class("echo")
    assert echo().generate([GenerationRequest("a", (1, 2), 0)], SAMPLING)[0].token_ids == [1, 2]
    with pytest.raises(ConfigError, match=r"^rollout.n: expected at most 4 with rollout.name=echo; found 8$"):
        apply_overrides(RunConfig(), ["rollout.name=echo"], ).validate()


# ---------------------------------------------------------------- the actor as a replica

def _actor(engine, version=0):
    from rlhf_core.workers.actor import ActorRolloutRefWorker

    actor = SimpleNamespace(rollout=engine, weight_version=version, policy_version=version, rank=0,
                            config=SimpleNamespace(model=SimpleNamespace(lora=False)), sync_dtype=None,
                            policy=torch.nn.Linear(2, 2))
    actor.sync_weights = lambda version=None: ActorRolloutRefWorker.sync_weights(actor, version)
    actor.generate_requests = lambda *a, **k: ActorRolloutRefWorker.generate_requests(actor, *a, **k)
    return actor


class FlakyEngine:
    """An engine whose weight load fails once, half-way through the stream."""

    def __init__(self):
        self.loaded, self.loading, self.fail_next, self.pad_id = [], False, False, 0

    @property
    def needs_weights(self):
        return self.loading

    def update_weights(self, named):
        self.loading = True
        for i, (name, _) in enumerate(named):
            if self.fail_next and i == 1:
                self.fail_next = False
                raise RuntimeError("connection reset while loading")
            self.loaded.append(name)
        self.loading = False

    def generate(self, requests, sampling):
        assert not self.loading, "generated from part of the weights"
        return [_answer_of(r) for r in requests]


def test_a_replica_refuses_a_version_it_does_not_hold_and_a_failed_sync_advances_nothing():
    engine = FlakyEngine()
    actor = _actor(engine, version=4)
    request = [("a", [1, 2], 7, None)]
    assert actor.generate_requests(request, SAMPLING, 4)["version"] == 4
    with pytest.raises(WeightVersionError, match=r"expected weight version 5; found 4"):
        actor.generate_requests(request, SAMPLING, 5)
    engine.fail_next = True
    with pytest.raises(RuntimeError, match="connection reset"):
        actor.sync_weights(5)
    assert actor.weight_version == 4 and engine.needs_weights  # not advanced; the engine asks again
    with pytest.raises(WeightVersionError):  # still not version 4's weights either: it syncs 5 first
        actor.generate_requests(request, SAMPLING, 4)
    assert actor.weight_version == 5 and not engine.needs_weights
    assert actor.generate_requests(request, SAMPLING, 5)["completions"][0][1] == _answer_of(
        GenerationRequest("a", (1, 2), 7)).token_ids


# ---------------------------------------------------------------- real Ray replicas

class _Group:
    """The one method the transport needs of a worker group, over plain Ray actors."""

    def __init__(self, actors):
        self.actors = actors

    def submit_to_rank(self, rank, method, *args):
        return getattr(self.actors[rank], method).remote(*args)


def test_real_ray_replicas_balance_and_one_that_dies_is_replaced(ray_local, tmp_path):
    """Two replicas as Ray actor processes: one exits in the middle of its first call (a
    real process death, whichever chunk it was given); its requests are served by the
    other with the same rows."""
    import ray

    from rlhf_core.rollout.manager import RayReplicaTransport

    @ray.remote(num_cpus=0)
    class Server:
        def __init__(self, die_on_call: int):
            self.die_on_call, self.calls = die_on_call, 0

        def generate_requests(self, requests, sampling, version):
            self.calls += 1
            if self.calls == self.die_on_call:
                os._exit(1)
            return {"completions": [(c.request_id, c.token_ids, c.log_probs) for c in
                                    (_answer_of(GenerationRequest(i, tuple(p), s)) for i, p, s, _ in requests)],
                    "version": version, "seconds": 0.0, "pad_id": 0}

    requests = _requests()
    healthy = _Group([Server.remote(0), Server.remote(0)])
    clean, _, _ = RolloutManager(replicas_of(2, 1), RayReplicaTransport(healthy)).generate(requests, SAMPLING, 2)
    dying = _Group([Server.remote(0), Server.remote(1)])
    out, versions, stats = RolloutManager(replicas_of(2, 1), RayReplicaTransport(dying)).generate(
        requests, SAMPLING, 2)
    assert out == clean == [_answer_of(r) for r in requests] and versions == [2] * len(requests)
    assert stats.replicas_lost == 1 and stats.per_replica == {0: len(requests), 1: 0}
    # one replica of three ranks that split each call (HF on an FSDP-sharded policy): each
    # rank its part, a rank left without one a filler (all must step together), dropped
    split = _Group([Server.remote(0) for _ in range(3)])
    few = requests[:4]
    out, _, stats = RolloutManager(replicas_of(3, 3, splits=True), RayReplicaTransport(split)).generate(
        few, SAMPLING, 2)
    assert out == [_answer_of(r) for r in few] and stats.per_replica == {0: 4}


# ---------------------------------------------------------------- the per-token loss mask

def test_the_last_generated_token_is_read_from_the_response_mask():
    """A multi-turn row: the policy's tokens, a tool's answer (attended, not trained), the
    policy's final turn, then padding. The outcome reward and a reward model's score go on
    the policy's last token; its length is every token after the prompt (verl's)."""
    from rlhf_core.algorithms import last_token_index
    from rlhf_core.protocol import DataProto
    from rlhf_core.trainer.metrics import compute_data_metrics
    from rlhf_core.workers.reward_model import scores_to_tokens

    response_mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0], [0] * 8,
                                  [1, 1, 0, 0, 0, 0, 0, 0]])
    attention = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0], [0] * 8,
                              [1, 1, 1, 1, 1, 1, 1, 1]])  # the last row: a tool answer cut at the limit
    assert last_token_index(response_mask).tolist() == [5, 2, 0, 1]
    scores = scores_to_tokens(torch.tensor([0.5, -1.0, 2.0, 3.0]), response_mask)
    assert scores[0, 5] == 0.5 and scores[1, 2] == -1.0 and scores[3, 1] == 3.0
    assert scores.abs().sum() == 4.5  # the empty row gets nothing
    batch = DataProto.from_dict({
        "response_mask": response_mask, "attention_mask": torch.cat([torch.ones(4, 2, dtype=torch.long), attention], 1),
        "token_level_scores": scores, "token_level_rewards": scores, "advantages": torch.zeros(4, 8),
        "returns": torch.zeros(4, 8), "prompts": torch.ones(4, 2, dtype=torch.long)})
    metrics = compute_data_metrics(batch, None, use_critic=False)
    assert (metrics["response_length/max"], metrics["response_length/min"]) == (8.0, 0.0)
    assert metrics["response_length/mean"] == (6 + 3 + 0 + 8) / 4


# ---------------------------------------------------------------- the checkpoint engine

def _weights() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [("embed.weight", torch.randn(64, 32, generator=g)),                      # 8 KiB
            ("layer.norm", torch.randn(32, generator=g).to(torch.bfloat16)),         # odd sizes and dtypes
            ("layer.proj", torch.randn(96, 100, generator=g)),                       # 37.5 KiB: over a bucket
            ("layer.count", torch.arange(7, dtype=torch.int64)),
            ("head.weight", torch.randn(16, 32, generator=g).to(torch.float16))]


def _weight_group_rank(rank: int, port: int, bucket: int, fail_after: int | None, out: str,
                       receiver_node: str | None = None) -> None:
    from rlhf_core.rollout import checkpoint_engine

    torch.set_num_threads(1)
    if rank == 0:
        store, _ = None, None
        import torch.distributed as dist
        from datetime import timedelta

        store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
        group = checkpoint_engine.WeightGroup("", 0, 0, 2, "gloo", timeout_s=60, store=store)

        def stream():
            for i, item in enumerate(_weights()):
                if fail_after is not None and i == fail_after:
                    raise RuntimeError("the trainer failed mid-sync")
                yield item

        try:
            sent = checkpoint_engine.send(group, stream(), bucket, version=7)
            torch.save({"sent": sent}, out + ".0")
        except RuntimeError as exc:
            torch.save({"error": str(exc)}, out + ".0")
    else:
        group = checkpoint_engine.WeightGroup("127.0.0.1", port, 1, 2, "gloo", timeout_s=10, node=receiver_node)
        got, versions, buckets = {}, [], []
        try:
            for name, tensor in checkpoint_engine.receive(group, on_version=versions.append):
                got[name] = tensor.clone()
                buckets.append(tensor.untyped_storage().nbytes())
            torch.save({"got": got, "versions": versions, "largest": max(buckets),
                        "shared": any("rlhf-weights-" in str(p) for p in group._shared)}, out + ".1")
        except Exception as exc:  # the sender went away mid-stream
            torch.save({"got": got, "versions": versions, "error": type(exc).__name__}, out + ".1")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("receiver_node", [None, "another-node"])
def test_the_checkpoint_engine_sends_every_tensor_in_bounded_buckets_and_the_version_last(tmp_path, receiver_node):
    """On one node the buckets go through shared memory; with a member on another node,
    through the group's broadcasts: the same tensors either way."""
    import torch.multiprocessing as mp

    out = str(tmp_path / "run")
    bucket = 16 * 1024
    mp.start_processes(_weight_group_rank, args=(_free_port(), bucket, None, out, receiver_node), nprocs=2,
                       start_method="spawn")
    sender, receiver = torch.load(out + ".0"), torch.load(out + ".1")
    assert receiver["shared"] == (receiver_node is None)
    expected = dict(_weights())
    assert list(receiver["got"]) == list(expected)
    assert all(torch.equal(receiver["got"][k], v) and receiver["got"][k].dtype == v.dtype for k, v in expected.items())
    assert receiver["versions"] == [7]
    # no buffer holds more than a bucket, but for a tensor larger than one, which goes alone
    assert receiver["largest"] <= max(bucket, 96 * 100 * 4 + 64) and sender["sent"] >= sum(
        t.numel() * t.element_size() for t in expected.values())


def test_a_sync_that_fails_midway_gives_the_replica_no_version(tmp_path):
    import torch.multiprocessing as mp

    out = str(tmp_path / "run")
    # a one-tensor bucket: the receiver has taken some tensors when the sender fails
    mp.start_processes(_weight_group_rank, args=(_free_port(), 1, 3, out), nprocs=2, start_method="spawn")
    sender, receiver = torch.load(out + ".0"), torch.load(out + ".1")
    assert sender["error"] == "the trainer failed mid-sync"
    assert receiver["versions"] == [] and "error" in receiver and 0 < len(receiver["got"]) < 5


def test_a_rollout_pool_of_its_own_is_checked_before_anything_is_placed():
    from rlhf_core.config import ConfigError, RunConfig, apply_overrides
    from rlhf_core.workers.worker_set import pool_plan

    own = ["rollout.mode=async", "rollout.nnodes=1", "rollout.checkpoint_engine.backend=gloo"]
    cfg = apply_overrides(RunConfig(), own).validate()
    assert [(p.name, p.process_on_nodes, p.roles) for p in pool_plan(cfg)][-1] == ("rollout", (1,), ("rollout",))
    for overrides, message in [
        (own[:2], r"^rollout.checkpoint_engine.backend: expected gloo with a rollout pool of its own on CPU nodes "
                  r"\(resources.gpus_per_node=0\); found naive$"),
        (["rollout.nnodes=1", "rollout.checkpoint_engine.backend=gloo"],
         r"^rollout.mode: expected async with a rollout pool of its own"),
        (["rollout.checkpoint_engine.backend=gloo"], r"^rollout.checkpoint_engine.backend: expected naive \(in place\)"),
        (own + ["rollout.checkpoint_engine.backend=nccl"], r"^rollout.checkpoint_engine.backend: expected gloo"),
        (own + ["rollout.n_gpus_per_node=3"], r"^rollout.n_gpus_per_node: expected at most 2 ranks per node"),
        (own + ["model.lora_rank=8"], r"^rollout.nnodes: expected 0 with a LoRA policy"),
        (own + ["rollout.checkpoint_engine.backend=nixl"], r"^rollout.checkpoint_engine.backend: expected one of"),
    ]:
        with pytest.raises(ConfigError, match=message):
            apply_overrides(RunConfig(), overrides).validate()
    # verl's names: the checkpoint engine's keys under actor_rollout_ref.rollout, the pool's as fully-async names them
    cfg = apply_overrides(RunConfig(), ["actor_rollout_ref.rollout.mode=async", "rollout.nnodes=1",
                                        "actor_rollout_ref.rollout.checkpoint_engine.backend=gloo",
                                        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=64"],
                          notes=[]).validate()
    assert (cfg.rollout.checkpoint_engine.backend, cfg.rollout.checkpoint_engine.update_weights_bucket_megabytes) == \
        ("gloo", 64)


def test_a_rollout_pool_of_its_own_runs_records_versions_and_replays_exactly(tmp_path, ray_local):
    """Trainer ranks on one side, one replica on the other (the HF engine on a copy of the
    policy it loaded, fed through gloo buckets): the run gives the colocated run's rewards
    bit for bit, every row records the weights that made it, every stage replays exactly."""
    import json

    from rlhf_core.cli import main
    from rlhf_core.record.iteration_store import IterationStore
    from rlhf_core.record.run_layout import RunRef
    from rlhf_core.trainer.replay import replay

    common = ["data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "rollout.n=4", "trainer.progress=false",
              "trainer.cpus_per_worker=1",
              "rollout.checkpoint_engine.update_weights_bucket_megabytes=1",  # several buckets a sync
              f"trainer.output_dir={tmp_path / 'out'}"]
    store = f"file://{tmp_path / 'store'}"
    assert main(["run", "--direct", "--iterations", "3", "--run-id", "pool", "--store", store, *common,
                 "rollout.mode=async", "rollout.nnodes=1", "rollout.checkpoint_engine.backend=gloo"]) == 0
    assert main(["run", "--direct", "--iterations", "3", "--run-id", "colocated", "--store", store, *common]) == 0

    def rows(run):
        return [json.loads(line) for line in (tmp_path / "out" / run / "metrics.jsonl").read_text().splitlines()]

    keys = ("critic/score/mean", "actor/pg_loss", "actor/entropy")
    assert [[r[k] for k in keys] for r in rows("pool")] == [[r[k] for k in keys] for r in rows("colocated")]
    pool = rows("pool")
    assert [r["training/weight_version"] for r in pool] == [1.0, 2.0, 3.0]
    assert all(r["perf/weight_sync_bytes"] > 1 * 2**20 for r in pool)  # the whole policy went through the group
    istore = IterationStore(RunRef(store, "pool"))
    for iteration in range(3):
        assert istore.load(iteration, "rollout").batch["weight_version"].tolist() == [iteration] * 32
    for r in replay(f"{store}/pool/iter-000002", log=lambda *a: None):
        assert r.ok and r.diffs and all(d.max_abs == 0 for d in r.diffs), (r.stage, r.diffs)


def test_a_rollout_snapshot_from_before_weight_versions_still_replays():
    """A snapshot written before rows recorded their weight version lacks the column: the
    replay's column is not a difference there; a recorded column the replay lacks is."""
    from rlhf_core.protocol import DataProto
    from rlhf_core.trainer.replay import compare

    old = DataProto.from_dict({"responses": torch.tensor([[1, 2]])})
    new = DataProto.from_dict({"responses": torch.tensor([[1, 2]]), "weight_version": torch.tensor([3])})
    diffs = compare(old, new)
    assert all(d.equal for d in diffs) and {d.kind for d in diffs} == {"exact", "not recorded"}
    assert not all(d.equal for d in compare(new, old))


def test_a_killed_senders_shared_buckets_are_removed_by_the_next_sender(tmp_path):
    """A SIGKILLed sender runs no finalizer: its /dev/shm buckets (named by its pid) stay
    until the next sender on the node removes them; a live sender's, files of another
    name and anything not this user's are left."""
    import os
    import subprocess

    from rlhf_core.rollout import checkpoint_engine

    dead = subprocess.Popen(["true"])
    dead.wait()
    names = [f"rlhf-weights-{dead.pid}-a1b2", f"rlhf-weights-{os.getpid()}-c3d4", "rlhf-weights-e5f6",
             "something-else"]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    removed = checkpoint_engine._remove_orphans(str(tmp_path))
    assert removed == [str(tmp_path / names[0])]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[1:])
