"""The GPU path, checked on the CPU: which device a Ray worker binds, that every stage moves
its batch to the worker's device and hands CPU tensors back, that a GPU pool refuses a node
without CUDA, and the process-group backend FSDP's CPU offload needs.

Device discipline runs the real workers under ``StandIn``: a second device played on the
CPU. Model parameters and whatever the worker moves with ``.to(sharding.device())`` are "on
the device" (and say so through ``.device``); the batch the controller sent and tensors
made without a device are "on the host". An op given both raises, as CUDA does (a 0-dim
host tensor is a scalar, and a host index may index a device tensor, as CUDA allows).
The ``meta`` device alone would not do: ``Embedding`` and ``gather`` accept a CPU tensor
with a meta one, and a meta tensor has no values for ``.item()`` or ``nonzero``.
"""

from __future__ import annotations

import itertools
import os
import socket
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

from rlhf_core.config import ConfigError, RunConfig, apply_overrides
from rlhf_core.controller import Worker
from rlhf_core.controller import worker as worker_module
from rlhf_core.runtime.gpus import local_device_index
from rlhf_core.protocol import DataProto
from rlhf_core.distributed import sharding
from rlhf_core.workers import devices, modeling

PROMPT, RESPONSE, ROWS = 6, 4, 4


def _config(tmp_path, extra=()) -> RunConfig:
    from rlhf_core.testing.model_folders import build_model_folder

    folder = tmp_path / "model"
    if not (folder / "config.json").exists():
        build_model_folder(folder)
    return apply_overrides(RunConfig(), [f"model.path={folder}", f"data.max_prompt_length={PROMPT}",
                                         f"rollout.response_length={RESPONSE}", "rollout.n=1",
                                         "actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=2",
                                         "actor.use_kl_loss=true", "actor.entropy_coeff=0.01", *extra])


def _actor(tmp_path, extra=()):
    from rlhf_core.workers.actor import ActorRolloutRefWorker

    return ActorRolloutRefWorker(_config(tmp_path, extra))


# ------------------------------------------------------------------ device index under Ray


@pytest.mark.parametrize("gpu_ids, visible, expected", [
    (["3"], "3", 0),                      # Ray narrows CUDA_VISIBLE_DEVICES to the worker's GPU
    (["GPU-b"], "GPU-b", 0),              # ... ids may be UUIDs
    (["3"], None, 3),                     # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES, no mask
    (["3"], "0,1,2,3", 3),                # NOSET, the node's list
    (["6"], "4,5,6,7", 2),                # NOSET, a node restricted to some GPUs
    (["GPU-b"], "GPU-a,GPU-b", 1),
    ([], "0", None),                      # no GPU from Ray: CPU pools keep their LOCAL_RANK
])
def test_the_device_index_is_the_gpu_rays_ids_name_among_the_visible_ones(gpu_ids, visible, expected):
    assert local_device_index(gpu_ids, visible) == expected


@pytest.mark.parametrize("fsdp_size, world, on_node, on_gpu, expected", [
    (-1, 16, 8, True, 16),   # verl's -1: one sharded copy over every rank
    (0, 16, 8, True, 8),     # auto, two GPU nodes: shard within each, replicate across (HSDP)
    (0, 8, 8, True, 8),      # auto, one node: plain FSDP
    (0, 16, 8, False, 16),   # auto on simulated CPU nodes: one group, as before
    (4, 16, 8, True, 4),
    (2, 2, 2, False, 2),
])
def test_the_shard_group_is_the_node_on_multi_node_gpu_pools(fsdp_size, world, on_node, on_gpu, expected):
    assert sharding.shard_group_size(fsdp_size, world, on_node, on_gpu) == expected


def test_a_shard_group_that_does_not_divide_the_ranks_is_one_line():
    with pytest.raises(ValueError, match=r"^actor.fsdp_config.fsdp_size: expected a divisor of the role's 8 ranks "
                                         r"\(or -1 / 0\); found 3$"):
        sharding.shard_group_size(3, 8, 8, True)
    with pytest.raises(ConfigError, match="actor.fsdp_config.fsdp_size: expected a divisor of actor.world_size=2"):
        apply_overrides(RunConfig(), ["actor.world_size=2", "actor.fsdp_config.fsdp_size=3"]).validate()


def test_a_gpu_id_missing_from_the_visible_devices_is_one_line_naming_both():
    with pytest.raises(RuntimeError, match=r"^CUDA_VISIBLE_DEVICES: expected Ray's GPU ids \['5'\] among the "
                                           r"visible devices; found '0,1'$"):
        local_device_index(["5"], "0,1")


def test_a_worker_binds_local_rank_and_the_current_device_to_its_ray_gpu(monkeypatch):
    """The bundle index (1 here) is no device index: the worker's GPU is device 0."""
    chosen = []
    monkeypatch.setattr(worker_module, "_ray_gpu_ids", lambda: ["1"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    Worker()
    assert os.environ["LOCAL_RANK"] == "0" and chosen == [0]


class Env(Worker):
    def env(self) -> dict:
        return {k: os.environ.get(k) for k in ("LOCAL_RANK", "CUDA_VISIBLE_DEVICES", "LOCAL_WORLD_SIZE")}


def test_every_rank_of_a_gpu_pool_binds_device_zero_of_its_own_gpu(ray_local):
    """Ray (with fake GPUs) gives each rank its own GPU through CUDA_VISIBLE_DEVICES; the
    rank of bundle 1 must not ask for device 1 (CUDA: 'invalid device ordinal')."""
    from rlhf_core.controller import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    pool = RayResourcePool([2], use_gpu=True, name_prefix="bind", cpus_per_process=0.5)
    group = RayWorkerGroup(pool, RayClassWithInitArgs(Env), name_prefix="bind_env")
    try:
        envs = group.execute_all("env")
    finally:
        group.kill()
        pool.release()
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "0"]
    assert [e["LOCAL_WORLD_SIZE"] for e in envs] == ["2", "2"]  # ranks on the node, as torchrun sets it
    assert len({e["CUDA_VISIBLE_DEVICES"] for e in envs}) == 2  # two different GPUs


# ------------------------------------------------------------------ a GPU pool needs CUDA


def test_a_gpu_pool_without_cuda_is_one_line_naming_the_node():
    with pytest.raises(RuntimeError, match=r"^resources.gpus_per_node=8: expected CUDA on every training node; "
                                           r"node pod-7 has none \(torch.cuda.is_available\(\) is False.*"
                                           r"or set resources.gpus_per_node=0 to train on CPU$") as err:
        devices.require_cuda(8, "GPU", False, "pod-7")
    assert "\n" not in str(err.value)
    devices.require_cuda(8, "GPU", True, "pod-7")       # CUDA there
    devices.require_cuda(0, "GPU", False, "pod-7")      # a CPU pool
    devices.require_cuda(2, "sim_gpu", False, "pod-7")  # a custom accelerator resource (simulated nodes)


def test_the_actor_refuses_to_train_on_cpu_in_a_gpu_pool(tmp_path, monkeypatch):
    monkeypatch.setattr(Worker, "init_process_group", lambda self, backend=None: backend)
    worker = _actor(tmp_path, ["resources.gpus_per_node=1"])
    with pytest.raises(RuntimeError, match=f"node {socket.gethostname()} has none"):
        worker.init_model()


# ------------------------------------------------------------------ the process-group backends


def test_a_gpu_group_has_a_cpu_backend_at_every_world_size():
    # gloo beside NCCL: dcp.async_save refuses a group without a CPU backend (one rank too),
    # and offloaded gradients all-reduce on the CPU
    assert devices.process_group_backend(on_gpu=True) == "cuda:nccl,cpu:gloo"
    assert devices.process_group_backend(on_gpu=False) == "gloo"


@pytest.mark.parametrize("offload", [False, True])
def test_a_worker_joins_with_nccl_and_gloo_on_a_gpu(monkeypatch, offload):
    joined = []
    monkeypatch.setattr(Worker, "init_process_group", lambda self, backend=None: joined.append(backend))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(sharding, "wrap", lambda model, spec, trainable=True, source=None: model)
    modeling.init_distributed_model(Worker(), torch.nn.Linear(2, 2), sharding.ShardingSpec(param_offload=offload))
    assert joined == ["cuda:nccl,cpu:gloo"]


# ------------------------------------------------------------------ device discipline of every stage

STANDIN = torch.device("meta")  # what sharding.device() answers under the stand-in
DEVICE, HOST = "device", "host"
MOVES = {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda}
INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}


class DeviceMismatch(AssertionError):
    pass


def _device_arg(value):
    if isinstance(value, torch.device):
        return value
    if isinstance(value, str):
        try:
            return torch.device(value)
        except RuntimeError:
            return None
    return None


class StandIn(TorchFunctionMode):
    """A second device played on the CPU (see the module's docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.place = WeakTensorKeyDictionary()

    def put(self, tensors, place: str) -> None:
        for t in tensors:
            self.place[t] = place

    def where(self, t: torch.Tensor) -> str:
        """A tensor nothing put on the device is on the host: also those made where no mode
        sees them (``torch.from_numpy``, tensors from before), as on a real machine."""
        return self.place.get(t, HOST)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is torch.Tensor.device:  # the .device property
            return STANDIN if self.where(args[0]) == DEVICE else func(*args, **kwargs)
        target = self._target(func, args, kwargs)
        if target is not None:
            args, kwargs = tree_map(lambda x: torch.device("cpu") if _device_arg(x) == STANDIN else x, (args, kwargs))
        inputs = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        if target is None:
            self._check(func, args, inputs)
        out = func(*args, **kwargs)
        if target is not None:
            place = target
        elif func is torch.Tensor.__getitem__:
            place = self.where(args[0])
        else:  # a tensor made without a device is made on the CPU
            place = DEVICE if any(self.where(t) == DEVICE for t in inputs) else HOST
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                if any(t is i for i in inputs):
                    if target is None:
                        continue  # in place: the tensor stays where it is
                    t = out = t.clone()  # a move copies
                self.place[t] = place
        return out

    @staticmethod
    def _target(func, args, kwargs):
        """Where a move or a factory's ``device=`` puts its result (None: follows its inputs)."""
        if func is torch.Tensor.cpu:
            return HOST
        if func is torch.Tensor.cuda:
            return DEVICE
        candidates = [kwargs.get("device")] + (list(args[1:]) if func is torch.Tensor.to else [])
        for value in candidates:
            device = _device_arg(value)
            if device is not None:
                return DEVICE if device == STANDIN or device.type == "cuda" else HOST
        return None

    def _check(self, func, args, inputs) -> None:
        if func in INDEXING:  # a host index may index a device tensor; not the other way round
            index = [t for t in tree_flatten(args[1])[0] if isinstance(t, torch.Tensor)]
            if self.where(args[0]) == HOST and any(self.where(t) == DEVICE for t in index):
                raise DeviceMismatch(f"{func.__name__}: a device index into a host tensor")
            return
        device = [t for t in inputs if self.where(t) == DEVICE]
        host = [t for t in inputs if self.where(t) == HOST and t.dim() > 0]
        if device and host:
            raise DeviceMismatch(f"{getattr(func, '__name__', func)}: host tensor {tuple(host[0].shape)} meets "
                                 f"device tensor {tuple(device[0].shape)}")


def test_the_stand_in_refuses_what_cuda_refuses():
    """Embedding and gather (which the meta device lets through) and elementwise ops."""
    mode = StandIn()
    weight, ids = torch.randn(5, 3), torch.tensor([[1, 2]])
    mode.put([weight], DEVICE)
    with mode:
        with pytest.raises(DeviceMismatch, match="embedding"):
            torch.nn.functional.embedding(ids, weight)
        with pytest.raises(DeviceMismatch, match="gather"):
            weight.gather(-1, torch.zeros(5, 1, dtype=torch.long))  # made without a device: host
        with pytest.raises(DeviceMismatch):
            _ = weight[:1, :2] * ids
        moved = ids.to(STANDIN)
        out = torch.nn.functional.embedding(moved, weight)  # moved first: fine
        assert out.device == STANDIN and ids.device.type == "cpu"
        assert torch.arange(2, device=moved.device).device == STANDIN  # follows a device tensor
        assert (weight * torch.tensor(2.0)).device == STANDIN  # a host scalar is a scalar
        back = out.cpu()
        assert back.device.type == "cpu" and mode.where(back) == HOST
        with pytest.raises(DeviceMismatch):  # made where no mode sees it: on the host
            _ = weight + torch.from_numpy(weight.detach().numpy().copy())


PROMPT_MASK = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * PROMPT, [0, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1]])


def _prompts() -> DataProto:
    """Left-padded prompts, one row per response to sample."""
    ids = torch.randint(3, 100, (ROWS, PROMPT), generator=torch.Generator().manual_seed(0)) * PROMPT_MASK
    return DataProto.from_dict({"input_ids": ids, "attention_mask": PROMPT_MASK.clone(),
                                "sample_seed": torch.arange(ROWS)})


def _batch() -> DataProto:
    """A rollout's output plus what later stages add: responses padded after their end,
    every column the log-prob, value and update stages read."""
    g = torch.Generator().manual_seed(1)
    prompt_mask, prompts = PROMPT_MASK, _prompts().batch["input_ids"]
    response_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]])
    responses = torch.randint(3, 100, (ROWS, RESPONSE), generator=g) * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    lp = -torch.rand(ROWS, RESPONSE, generator=g)
    data = DataProto.from_dict({
        "prompts": prompts, "responses": responses, "response_mask": response_mask,
        "input_ids": torch.cat([prompts, responses], dim=1), "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),
        "old_log_probs": lp, "ref_log_prob": lp - 0.1, "advantages": torch.randn(ROWS, RESPONSE, generator=g),
        "values": torch.randn(ROWS, RESPONSE, generator=g), "returns": torch.randn(ROWS, RESPONSE, generator=g)})
    data.meta_info["global_step"] = 1
    return data


def _on_stand_in(monkeypatch, *models) -> StandIn:
    """The models' parameters and buffers on the stand-in device; ``sharding.device()`` it."""
    mode = StandIn()
    monkeypatch.setattr(sharding, "device", lambda: STANDIN)
    mode.put(itertools.chain.from_iterable(itertools.chain(m.parameters(), m.buffers()) for m in models), DEVICE)
    return mode


def _run_stage(mode: StandIn, method, data: DataProto) -> DataProto:
    with mode:  # what the controller sent is on the host
        out = method(data)
    on_device = [k for k, v in (out.batch.items() if out.batch is not None else ()) if mode.where(v) == DEVICE]
    assert not on_device, f"{method.__name__} returned device tensors {on_device}; the controller expects CPU ones"
    return out


@pytest.fixture(scope="module")
def actor(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setattr(Worker, "init_process_group", lambda self, backend=None: backend)
    worker = _actor(tmp_path_factory.mktemp("actor"))
    worker.init_model()
    mp.undo()
    return worker


@pytest.fixture(scope="module")
def critic(tmp_path_factory):
    from rlhf_core.workers.critic import CriticWorker

    mp = pytest.MonkeyPatch()
    mp.setattr(Worker, "init_process_group", lambda self, backend=None: backend)
    worker = CriticWorker(_config(tmp_path_factory.mktemp("critic")))
    worker.init_model()
    mp.undo()
    return worker


@pytest.mark.parametrize("stage", ["compute_log_prob", "compute_ref_log_prob", "update_actor"])
def test_actor_stages_move_the_batch_to_the_device_and_return_cpu_tensors(actor, monkeypatch, stage):
    mode = _on_stand_in(monkeypatch, actor.policy, actor.reference)
    out = _run_stage(mode, getattr(actor, stage), _batch())
    if stage == "update_actor":
        assert len(out.meta_info["metrics"]["actor/pg_loss"]) == 2  # the update ran: 2 mini-batches
    else:
        assert out.batch.batch_size[0] == ROWS and torch.isfinite(out.batch[list(out.batch.keys())[0]]).all()


def test_hf_rollout_generates_on_the_device_and_returns_cpu_tensors(actor, monkeypatch):
    assert actor.config.rollout.name == "hf"
    mode = _on_stand_in(monkeypatch, actor.policy)
    out = _run_stage(mode, actor.generate_sequences, _prompts())
    assert out.batch["responses"].shape == (ROWS, RESPONSE) and out.batch["response_mask"].sum() > 0


@pytest.mark.parametrize("stage", ["compute_values", "update_critic"])
def test_critic_stages_move_the_batch_to_the_device_and_return_cpu_tensors(critic, monkeypatch, stage):
    mode = _on_stand_in(monkeypatch, critic.critic)
    out = _run_stage(mode, getattr(critic, stage), _batch())
    if stage == "update_critic":
        assert len(out.meta_info["metrics"]["critic/vf_loss"]) == 2
    else:
        assert out.batch["values"].shape == (ROWS, RESPONSE)


def test_on_a_cpu_worker_the_moves_are_the_same_tensors():
    """CPU runs compute what they computed before: no copy, no new DataProto."""
    data = _batch()
    assert devices.to_device(data) is data
    t = torch.zeros(2)
    assert devices.to_host({"t": t, "none": None}) == {"t": t, "none": None}
    assert devices.to_host({"t": t})["t"] is t


def _smoke_module():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_smoke.py"
    spec = importlib.util.spec_from_file_location("gpu_smoke", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("gpus", [1, 2])
def test_the_gpu_smoke_check_trains_what_the_gpu_examples_run(gpus, tmp_path):
    """benchmarks/gpu_smoke.py generates with vLLM over every GPU it uses (TP = ranks),
    trains with FSDP2 over them, and its config validates as written."""
    cfg = _smoke_module().smoke_config(str(tmp_path / "model"), str(tmp_path / "train.parquet"), gpus)
    assert cfg.rollout.name == "vllm" and cfg.rollout.tensor_model_parallel_size == gpus
    assert cfg.actor.strategy == "fsdp" and cfg.actor.world_size == gpus and cfg.resources.gpus_per_node == gpus
    assert cfg.rollout.free_cache_engine  # sleep/wake around training


def test_the_gpu_smoke_check_prints_one_line_per_step_and_stops_at_the_first_failure(capsys):
    steps = _smoke_module().Steps()
    assert steps.run("first", lambda: 7) == 7
    assert steps.run("second", lambda: 1 / 0) is None
    assert steps.run("third", lambda: 3) is None  # not run after a failure
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert [line.split(" (")[0] for line in lines] == ["PASS first", "FAIL second"] and steps.failed
    assert lines[1].endswith("ZeroDivisionError: division by zero")


def test_an_update_reads_its_metrics_from_the_device_once_per_optimizer_step(actor, monkeypatch):
    """Host reads (``item``, ``tolist``, ``float``, ``int``, ``bool`` of a tensor) in an
    actor update do not grow with the number of micro-batches: the metrics stay tensors
    and are read once per optimizer step. (Each forward's padding trim reads which columns
    its rows use: one read per micro-batch, counted apart.)"""
    reads: list[str] = []
    trims: list[int] = []
    real_trim = modeling.trim_padding

    def counting_trim(*args, **kwargs):
        trims.append(1)
        return real_trim(*args, **kwargs)

    def count(name):
        real = getattr(torch.Tensor, name)

        def counted(self, *args, **kwargs):
            reads.append(name)
            return real(self, *args, **kwargs)
        return counted

    def reads_per_step(micro_rows: int) -> float:
        monkeypatch.setattr(actor.config.actor, "ppo_micro_batch_size_per_gpu", micro_rows)
        data = _batch()
        reads.clear()
        trims.clear()
        with monkeypatch.context() as m:
            m.setattr(modeling, "trim_padding", counting_trim)
            for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
                m.setattr(torch.Tensor, name, count(name))
            out = actor.update_actor(data)
        steps = len(out.meta_info["metrics"]["actor/pg_loss"])
        return (len(reads) - len(trims)) / steps, len(trims) / steps

    whole, whole_trims = reads_per_step(0)   # a mini-batch of 2 rows in one micro-batch
    split, split_trims = reads_per_step(1)   # ... in two
    assert split_trims == 2 * whole_trims
    assert split == whole, (whole, split)


def test_a_rank_that_builds_on_the_meta_device_samples_with_the_checkpoints_generation_config(tmp_path):
    """Ranks other than 0 build from the config alone (FSDP over several ranks): they read
    generation_config.json as from_pretrained does, or HF generation would differ by rank."""
    from transformers import GenerationConfig

    from rlhf_core.testing.model_folders import build_model_folder

    folder = build_model_folder(tmp_path / "tiny")
    GenerationConfig(do_sample=True, top_k=7, repetition_penalty=1.3).save_pretrained(folder)
    loaded, empty = modeling.load_causal_lm(str(folder)), modeling.load_causal_lm(str(folder), empty=True)
    assert next(empty.parameters()).is_meta
    assert (empty.generation_config.top_k, empty.generation_config.repetition_penalty) == (7, 1.3)
    assert empty.generation_config.to_diff_dict() == loaded.generation_config.to_diff_dict()


def test_fsdp_size_must_divide_the_critics_own_pool_too():
    with pytest.raises(ConfigError, match=r"^actor.fsdp_config.fsdp_size: expected a divisor of critic.world_size=3"):
        apply_overrides(RunConfig(), ["algorithm.adv_estimator=gae", "actor.world_size=2", "critic.world_size=3",
                                      "resources.critic_nnodes=1", "resources.cpus_per_node=8",
                                      "actor.fsdp_config.fsdp_size=2"]).validate()
