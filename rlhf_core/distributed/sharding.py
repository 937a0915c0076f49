"""How the ranks of a role share a trained model: FSDP2 or DDP, on gloo or NCCL alike.

``fsdp`` shards parameters, gradients and optimizer state across the role's ranks
(``fully_shard`` on every decoder layer, then on the root), so a rank holds about 1/N of
them and gathers one layer at a time to compute. ``ddp`` keeps everything on every rank
and all-reduces gradients. On one rank both train the plain module.

Everything that has to see the model across ranks goes through this module: the sharded
state checkpoints save and load (``torch.distributed.checkpoint`` reshards it to any world
size), whole state dicts, and the stream of full parameters for weight sync (one tensor
gathered at a time, never a model copy).
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import Iterator

import torch



@dataclass(frozen=True)
class ShardingSpec:
    """What ``wrap`` needs from the run config (``actor.strategy`` + ``actor.fsdp_config``)."""

    strategy: str = "fsdp"
    param_offload: bool = False        # FSDP: parameters, gradients and optimizer step on the CPU
    reshard_after_forward: bool = True  # FSDP: free gathered layers after forward (ZeRO-3) or keep (ZeRO-2)
    mixed_precision: str = "auto"      # auto: bf16 compute + fp32 reduction on GPU, fp32 on CPU
    activation_checkpointing: bool = False
    fsdp_size: int = -1                 # FSDP: ranks per sharded copy (-1 all, 0 each node's); see shard_group_size

    @classmethod
    def from_config(cls, cfg, param_offload: bool | None = None) -> "ShardingSpec":
        fsdp = cfg.actor.fsdp_config
        return cls(strategy=cfg.actor.strategy,
                   param_offload=fsdp.param_offload if param_offload is None else param_offload,
                   reshard_after_forward=fsdp.reshard_after_forward, mixed_precision=fsdp.mixed_precision,
                   activation_checkpointing=cfg.model.enable_gradient_checkpointing, fsdp_size=fsdp.fsdp_size)


def shard_group_size(fsdp_size: int, world: int, ranks_on_node: int, on_gpu: bool) -> int:
    """How many ranks one sharded copy of the model spans (the rest of the world replicates
    it: HSDP). ``fsdp_size`` -1: all; 0 (auto): all, except on a GPU pool over several nodes,
    where each node's ranks (FSDP gathers every layer each forward and backward: within a
    node that runs over NVLink; across nodes, over the network, and only the gradient
    all-reduce between replicas crosses it then); k: k. Simulated CPU pools keep one group.
    """
    if fsdp_size == -1 or (fsdp_size == 0 and not (on_gpu and 0 < ranks_on_node < world)):
        return world
    size = ranks_on_node if fsdp_size == 0 else fsdp_size
    if size > world or world % size:
        raise ValueError(f"actor.fsdp_config.fsdp_size: expected a divisor of the role's {world} ranks (or -1 / "
                         f"0); found {size}")
    return size


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks (the classes HF lists in ``_no_split_modules``:
    ``Qwen2DecoderLayer``, ``LlamaDecoderLayer``, ...), in module order."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def _enable_activation_checkpointing(model: torch.nn.Module) -> None:
    for module in model.modules():
        if hasattr(module, "gradient_checkpointing_enable"):
            # non-reentrant: works under FSDP2 and with inputs that need no grad
            module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            return
    raise ValueError(f"model.enable_gradient_checkpointing: {type(model).__name__} has no HF backbone "
                     f"to checkpoint")


@dataclass(frozen=True)
class FullWeights:
    """Rank 0's whole model, taken before it is sharded, to fill every rank's shards from:
    its state dict, and its buffers (non-persistent ones, such as rotary frequencies, are in
    no state dict)."""

    state: dict
    buffers: dict

    @classmethod
    def of(cls, model: torch.nn.Module) -> "FullWeights":
        # detached tensors keep the loaded storage: sharding gives the module new tensors
        return cls({k: v.detach() for k, v in model.state_dict().items()},
                   {k: v.detach() for k, v in model.named_buffers()})


def loads_from_rank0(strategy: str, world: int) -> bool:
    """Under FSDP over several ranks rank 0 alone reads a model's weights; the others build
    the model on the meta device and ``wrap`` broadcasts rank 0's weights into every rank's
    shards (verl's full-state-dict load: the checkpoint is read, and the whole model held
    in host memory, once per node's rank 0 instead of once per rank)."""
    return strategy == "fsdp" and world > 1


def reads_checkpoint(strategy: str, rank: int, world: int) -> bool:
    """Whether this rank reads a model's weights from its checkpoint (``loads_from_rank0``)."""
    return rank == 0 or not loads_from_rank0(strategy, world)


def computes_in_bf16(spec: ShardingSpec) -> bool:
    """Whether the model's forward runs in bf16 under ``spec`` (FSDP's mixed precision)."""
    return spec.strategy == "fsdp" and (spec.mixed_precision == "bf16" or
                                        (spec.mixed_precision == "auto" and torch.cuda.is_available()))


def _on_meta(model: torch.nn.Module) -> bool:
    return any(t.is_meta for t in model.parameters())


def _fill_from_rank0(model: torch.nn.Module, source: FullWeights | None, where: torch.device) -> None:
    """Every rank's shards from rank 0's ``source`` (a collective: all ranks call it). One
    tensor at a time is cast to its shard's dtype (a bf16 reference from fp32 weights:
    half the bytes), broadcast whole on ``where`` and sliced into the shards, wherever
    they live: an offloaded model's shards are in host memory, but its broadcast runs on
    the GPU (NCCL), not through the host (gloo: ~30 GB to each of 15 ranks at 7B)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor

    if rank() == 0 and source is None:
        raise ValueError("rank 0 shards a model built on the meta device: pass its weights (FullWeights.of)")
    if _on_meta(model):
        # allocated in the module's dtypes; buffers land where rank 0's are (one backend per broadcast)
        model.to_empty(device=where)
    several = dist.is_initialized() and world_size() > 1
    with torch.no_grad():
        for name, target in model.state_dict().items():
            full = (source.state[name].to(device=where, dtype=target.dtype) if rank() == 0
                    else torch.empty(target.shape, dtype=target.dtype, device=where))
            if several:
                dist.broadcast(full, src=0)
            if isinstance(target, DTensor):
                target.to_local().copy_(
                    distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local())
            else:
                target.copy_(full)
            del full
    for name, buffer in model.named_buffers():
        if rank() == 0:
            buffer.copy_(source.buffers[name])
        if several:
            dist.broadcast(buffer, src=0)


def wrap(model: torch.nn.Module, spec: ShardingSpec, trainable: bool = True,
         source: FullWeights | None = None) -> torch.nn.Module:
    """``model`` prepared for this process group under ``spec`` (the process group must
    be initialised). ``trainable=False`` (the reference model) shards without gradients.
    ``source``: rank 0's whole weights, taken before sharding, where ``model`` was built on
    the meta device (the other ranks under FSDP, see ``reads_checkpoint``; or any model
    that is a copy of another, such as the reference): every rank's shards are filled
    from it after sharding.

    FSDP wraps at every world size on a GPU, one rank included: its mixed precision (bf16
    compute, fp32 reduction) and CPU offload are FSDP's, so a one-GPU run trains as a
    many-GPU one does, not in fp32 (verl and torchtitan shard one rank too). On a CPU
    machine one rank trains the plain module unless bf16 is asked for."""
    import torch.distributed as dist

    if spec.activation_checkpointing and trainable:
        _enable_activation_checkpointing(model)
    ranks = world_size()
    on_gpu = torch.cuda.is_available()
    bf16 = computes_in_bf16(spec)
    sharded = spec.strategy == "fsdp" and (ranks > 1 or on_gpu or bf16)
    if not sharded and _on_meta(model):  # a copy filled in this process: every rank has the weights
        if source is None:
            raise ValueError(f"a model built on the meta device under actor.strategy={spec.strategy} at "
                             f"{ranks} rank(s): pass its weights (FullWeights.of)")
        model.to_empty(device=torch.device("cpu"))
        if hasattr(model, "tie_weights"):  # to_empty gives tied parameters one tensor each
            model.tie_weights()
        model.load_state_dict(source.state)
        for name, buffer in model.named_buffers():
            buffer.copy_(source.buffers[name])
    if spec.strategy == "ddp" and (ranks == 1 or not trainable):
        # one rank: nothing to share; a frozen model under DDP is a plain replica
        return model.to(device()) if on_gpu else model
    if spec.strategy == "fsdp" and not sharded:
        return model  # fp32 on one CPU rank: FSDP would only add its hooks
    if spec.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        if on_gpu:
            model = model.to(device())
            return DistributedDataParallel(model, device_ids=[device().index])
        return DistributedDataParallel(model)

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    # a (replicas, shards) mesh gives HSDP: shards within a group, gradients all-reduced across
    shards = shard_group_size(spec.fsdp_size, ranks, int(os.environ.get("LOCAL_WORLD_SIZE", ranks)), on_gpu)
    mesh = init_device_mesh("cuda" if on_gpu else "cpu", (ranks // shards, shards) if shards < ranks else (ranks,),
                            mesh_dim_names=("replicate", "shard") if shards < ranks else ("shard",))
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16
              else MixedPrecisionPolicy())
    # on a CPU machine the parameters are already in host memory: offloading is a no-op
    offload = CPUOffloadPolicy() if spec.param_offload and on_gpu else OffloadPolicy()
    # no model.to(device()) first: fully_shard moves each layer's parameters to the mesh's
    # device as it shards them, so the whole model is never on one GPU at once
    options = dict(mesh=mesh, mp_policy=policy, offload_policy=offload,
                   reshard_after_forward=spec.reshard_after_forward)
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"actor.strategy=fsdp: found no decoder layers in {type(model).__name__} (no "
                         f"_no_split_modules); use actor.strategy=ddp for this model")
    for layer in layers:
        fully_shard(layer, **options)
    fully_shard(model, **options)
    if source is not None or _on_meta(model):
        # on the GPU even when offloaded: FSDP keeps buffers there (rank 0's are already), and
        # offloaded shards go back to pinned host memory as to_empty re-registers them
        _fill_from_rank0(model, source, device())
    return model


def keep_gathered_after_backward(model: torch.nn.Module, keep: bool) -> None:
    """FSDP2's ``reshard_after_backward`` off (``keep``) for a micro-batch that another of
    the same optimizer step follows: its layers stay gathered into the next forward, which
    then needs no all-gather; the step's last micro-batch reshards. A no-op for other models."""
    if is_sharded(model):
        model.set_reshard_after_backward(not keep)


def all_reduce_across_replicas(model: torch.nn.Module, now: bool) -> None:
    """HSDP (``fsdp_size`` below the world): every micro-batch's gradients are
    reduce-scattered within the shard group (each rank then accumulates its own shard),
    but all-reduced across the replica groups only when ``now``: on the last micro-batch of
    an optimizer step, so the traffic between nodes is once a step, not once a micro-batch.
    The sum is the same. A no-op for other models."""
    if is_sharded(model):
        model.set_requires_all_reduce(now)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose forward to call outside training (DDP's inner module; an FSDP2
    module is itself)."""
    return model.module if hasattr(model, "module") and not is_sharded(model) else model


def grad_norm_and_clip(model: torch.nn.Module, max_norm: float) -> float:
    """Clip the global gradient norm (across every rank's shards) and return it."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


# ------------------------------------------------------------------ whole-model views

def _full_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_state(model: torch.nn.Module, optimizer) -> tuple[dict, dict]:
    """(model state, optimizer state) as whole tensors on rank 0's CPU, keyed by parameter
    name (to compare or export whole models; checkpoints use ``sharded_state``). Every
    rank must call it; ranks other than 0 get empty dicts."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    if world_size() == 1:
        model = unwrap(model)
    options = _full_options()
    return get_model_state_dict(model, options=options), get_optimizer_state_dict(model, optimizer, options=options)


def _has_frozen(model: torch.nn.Module) -> bool:
    return any(not p.requires_grad for p in model.parameters())


def sharded_state(model: torch.nn.Module, optimizer) -> dict:
    """{"model", "optim"}: this rank's shards (FSDP) or whole tensors (DDP, one rank),
    keyed by parameter name, as ``torch.distributed.checkpoint`` saves and reshards them.
    A model with frozen parameters (LoRA's base) gives only the trained ones: its
    checkpoint is the adapter and its optimizer state, the base is the run's model.path."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model = unwrap(model)
    frozen = _has_frozen(model)
    model_state, optim_state = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=frozen))
    if frozen:  # a tied weight's second name (lm_head of tied embeddings) escapes DCP's filter
        names = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
        model_state = {name: t for name, t in model_state.items() if name not in names}
    return {"model": model_state, "optim": optim_state}


def set_sharded_state(model: torch.nn.Module, optimizer, state: dict) -> None:
    """Load ``sharded_state``'s shape back; the frozen parameters it left out stay as they are."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    model = unwrap(model)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(strict=not _has_frozen(model)))


def all_gather_objects(obj) -> list:
    """Every rank's ``obj`` (a small picklable object), in rank order."""
    import torch.distributed as dist

    if world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class GatherMeter:
    """Peak bytes of gathered (whole) tensors alive at once while streaming weights, and
    the bytes streamed in all."""

    def __init__(self) -> None:
        self.live = self.peak = self.count = self.total = 0

    def track(self, tensor: torch.Tensor) -> torch.Tensor:
        size = tensor.numel() * tensor.element_size()
        self.live += size
        self.total += size
        self.count += 1
        self.peak = max(self.peak, self.live)
        weakref.finalize(tensor, self._freed, size)
        return tensor

    def _freed(self, size: int) -> None:
        self.live -= size


def stream_full_parameters(model: torch.nn.Module, meter: GatherMeter | None = None,
                           dtype: torch.dtype | None = None,
                           keep=None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) for every parameter and buffer, one at a time: a sharded
    tensor is all-gathered when its turn comes and dropped by the consumer before the
    next, so the extra memory is one tensor, not a model copy. Under FSDP every rank must
    consume the whole stream in the same order (each gather is a collective).

    ``dtype``: floating-point tensors are cast to it before they are gathered (bf16 for an
    engine that serves bf16 moves half the bytes of the fp32 master weights).

    ``keep``: a test of the name; the tensors it refuses are neither gathered nor yielded
    (every rank applies the same test, so the gathers stay in step)."""
    for name, tensor in unwrap(model).state_dict().items():
        if keep is not None and not keep(name):
            continue
        tensor = tensor.detach()
        if hasattr(tensor, "full_tensor"):
            if torch.cuda.is_available() and tensor.device.type == "cpu":  # offloaded shard: gather on GPU
                tensor = tensor.to(device())
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(dtype)  # this rank's shard: the gather then moves the smaller dtype
            tensor = tensor.full_tensor()
            if meter is not None:
                meter.track(tensor)
        elif dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        yield name, tensor


def move_optimizer_state(optimizer, to: torch.device) -> None:
    """Optimizer offload: AdamW's moments live on the CPU between updates and come back to
    the accelerator for the step (a no-op on CPU machines)."""
    if to.type == "cpu" and not torch.cuda.is_available():
        return
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and key != "step":
                state[key] = value.to(to, non_blocking=True)
