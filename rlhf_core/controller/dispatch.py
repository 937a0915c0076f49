"""``@register`` and the dispatch modes: how one controller call becomes per-rank calls.

A worker method declares how its arguments are split across the ranks of a WorkerGroup
(``dispatch``) and how the per-rank results are merged (``collect``)::

    class Actor(Worker):
        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
        def compute_log_prob(self, data: DataProto) -> DataProto: ...

    log_probs = actor_wg.compute_log_prob(batch)   # chunk -> remote x N -> concat

Every dispatch function has the signature ``dispatch(worker_group, *args, **kwargs) ->
(args, kwargs)`` where each returned argument is a list with one entry per rank; every
collect function is ``collect(worker_group, outputs: list) -> result``. Modes are looked up
in a registry, so users add their own with :func:`register_dispatch_mode` (names follow
verl so that ported workers keep their decorators).
"""

from __future__ import annotations

import enum
import functools
import inspect
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from rlhf_core.protocol import DataProto, DataProtoFuture, pad_dataproto_to_divisor

MAGIC_ATTR = "__rlhf_register__"
#: kwarg through which a dispatch function tells the group call how many padding rows to
#: drop from the collected result.
PADDING_KWARG = "_rlhf_padding_rows"


class Dispatch(str, enum.Enum):
    """Built-in dispatch modes (verl's names). Custom modes are registered by name."""

    RANK_ZERO = "RANK_ZERO"
    ONE_TO_ALL = "ONE_TO_ALL"
    ALL_TO_ALL = "ALL_TO_ALL"
    DP_COMPUTE = "DP_COMPUTE"
    DP_COMPUTE_PROTO = "DP_COMPUTE_PROTO"
    DP_COMPUTE_PROTO_WITH_FUNC = "DP_COMPUTE_PROTO_WITH_FUNC"
    DP_COMPUTE_METRIC = "DP_COMPUTE_METRIC"
    DIRECT_ROLLOUT_METHOD = "DIRECT_ROLLOUT_METHOD"


class Execute(str, enum.Enum):
    """Which ranks run the method: all of them, or only rank 0."""

    ALL = "ALL"
    RANK_ZERO = "RANK_ZERO"


@dataclass(frozen=True)
class DispatchMode:
    name: str
    dispatch_fn: Callable
    collect_fn: Callable


_DISPATCH_MODES: dict[str, DispatchMode] = {}


def register_dispatch_mode(name: str, dispatch_fn: Callable, collect_fn: Callable) -> str:
    """Add a custom dispatch mode; use ``@register(dispatch_mode=name)`` afterwards."""
    if name in _DISPATCH_MODES:
        raise ValueError(f"dispatch mode {name!r} is already registered")
    _DISPATCH_MODES[name] = DispatchMode(name, dispatch_fn, collect_fn)
    return name


def get_dispatch_mode(mode: Any) -> DispatchMode:
    """Resolve a Dispatch member, a registered name or a ``{"dispatch_fn", "collect_fn"}``
    dict into a :class:`DispatchMode`."""
    if isinstance(mode, dict):
        missing = {"dispatch_fn", "collect_fn"} - set(mode)
        if missing:
            raise ValueError(f"a custom dispatch_mode dict needs {sorted(missing)}")
        return DispatchMode("custom", mode["dispatch_fn"], mode["collect_fn"])
    name = mode.value if isinstance(mode, Dispatch) else mode
    if name not in _DISPATCH_MODES:
        raise ValueError(f"unknown dispatch mode {mode!r}; registered: {sorted(_DISPATCH_MODES)}")
    return _DISPATCH_MODES[name]


# ------------------------------------------------------------------ fencing

#: The keyword a fenced group call carries to every rank: the claim of the controller that
#: sends it (a session's claim number, raised by each controller that attaches).
FENCE_KWARG = "_rlhf_claim"


class StaleClaimError(RuntimeError):
    """A call from a controller whose claim on the workers another controller replaced."""


class _Fence:
    """The highest claim this worker process has seen. A call carrying a lower one is
    refused before it runs; the check and the raise are one step under a lock, so two
    controllers' calls cannot both pass on one rank."""

    def __init__(self) -> None:
        self.claim, self._lock = 0, threading.Lock()

    def admit(self, claim, method: str) -> None:
        if isinstance(claim, bool) or not isinstance(claim, int) or claim < 0:
            raise StaleClaimError(f"{method}: {FENCE_KWARG}: expected a claim number >= 0; found {claim!r}")
        with self._lock:
            if claim < self.claim:
                raise StaleClaimError(f"{method}: refused: the call carries claim {claim} and claim {self.claim} "
                                      f"drives these workers now (another controller took them over)")
            self.claim = claim


#: One per worker process (colocated roles share it: they share the weights' process).
FENCE = _Fence()


def _with_fence_keyword(sig: inspect.Signature) -> inspect.Signature:
    params = [p for p in sig.parameters.values() if p.name != FENCE_KWARG]
    fence = inspect.Parameter(FENCE_KWARG, inspect.Parameter.KEYWORD_ONLY, default=None)
    at = next((i for i, p in enumerate(params) if p.kind is inspect.Parameter.VAR_KEYWORD), len(params))
    return sig.replace(parameters=params[:at] + [fence] + params[at:])


# ------------------------------------------------------------------ the decorator


def register(dispatch_mode: Any = Dispatch.ALL_TO_ALL, execute_mode: Execute = Execute.ALL,
             blocking: bool = True, materialize_futures: bool = True) -> Callable:
    """Mark a Worker method as callable on its WorkerGroup.

    ``dispatch_mode`` splits the arguments per rank and merges the results; ``execute_mode``
    picks the ranks that run; ``blocking=False`` makes the group call return futures (a
    DataProtoFuture for DataProto modes) that can be passed straight into the next call.
    With ``materialize_futures`` the worker resolves DataProtoFuture arguments itself.
    """
    get_dispatch_mode(dispatch_mode)  # fail at import time on a typo, not at first call
    if not isinstance(execute_mode, Execute):
        execute_mode = Execute(execute_mode)

    def decorator(func):
        @functools.wraps(func)
        def inner(self, *args, **kwargs):
            claim = kwargs.pop(FENCE_KWARG, None)
            if claim is not None:  # before anything of the call runs (its futures included)
                FENCE.admit(claim, func.__name__)
            if materialize_futures:
                args, kwargs, trim = _materialize(args, kwargs)
            else:
                trim = 0
            start = time.perf_counter()
            output = func(self, *args, **kwargs)
            if trim and isinstance(output, DataProto):
                output = output.slice(0, len(output) - trim)
            if isinstance(output, DataProto):
                # Self-reported compute time: lets the controller tell time spent inside
                # workers from dispatch/collect overhead (it pops this before using data).
                metrics = output.meta_info.setdefault("metrics", {})
                metrics["timing_worker_s"] = time.perf_counter() - start
            return output

        # Ray checks a call's arguments against the method's signature, unwrapped: the
        # wrapper's own signature (with the fence keyword) is what it must see
        inner.__signature__ = _with_fence_keyword(inspect.signature(func))
        del inner.__wrapped__
        inner.__registered__ = func  # the method as written (its source, for reading and tests)
        setattr(inner, MAGIC_ATTR, {"dispatch_mode": dispatch_mode, "execute_mode": execute_mode,
                                    "blocking": blocking})
        return inner

    return decorator


def _materialize(args, kwargs):
    """Resolve DataProtoFuture arguments on the worker; returns how many trailing rows of
    this rank's share are padding (to be trimmed from a DataProto output)."""
    trim = 0

    def resolve(value):
        nonlocal trim
        if isinstance(value, _FutureShare):
            data, pad = value.resolve()
            trim = max(trim, pad)
            return data
        if isinstance(value, DataProtoFuture):
            return value.get()
        return value

    return tuple(resolve(a) for a in args), {k: resolve(v) for k, v in kwargs.items()}, trim


@dataclass
class _FutureShare:
    """One rank's share of a DataProtoFuture: resolved on the worker, never on the
    controller. Uneven batches are padded (repeating rows) so every rank gets the same
    number of rows (DDP collectives need that); the worker trims the padding from its
    output before returning it."""

    future: DataProtoFuture
    rank: int
    world_size: int

    def resolve(self) -> tuple[DataProto, int]:
        full = self.future.get()
        padded, pad = pad_dataproto_to_divisor(full, self.world_size)
        share = len(padded) // self.world_size
        part = padded.slice(self.rank * share, (self.rank + 1) * share)
        real_rows = max(0, min(share, len(full) - self.rank * share))
        return part, share - real_rows


# ------------------------------------------------------------------ built-in modes


def _world(wg) -> int:
    return wg.world_size


def dispatch_one_to_all(wg, *args, **kwargs):
    n = _world(wg)
    return tuple([a] * n for a in args), {k: [v] * n for k, v in kwargs.items()}


def dispatch_all_to_all(wg, *args, **kwargs):
    return args, kwargs


def dispatch_dp_compute(wg, *args, **kwargs):
    n = _world(wg)
    for i, value in enumerate(list(args) + list(kwargs.values())):
        if not isinstance(value, (list, tuple)) or len(value) != n:
            found = f"{type(value).__name__} of length {len(value)}" if isinstance(value, (list, tuple)) \
                else type(value).__name__
            raise ValueError(f"DP_COMPUTE: every argument must be a list with one entry per rank "
                             f"({n}); argument {i} is {found}")
    return args, kwargs


def collect_all_to_all(wg, outputs):
    return outputs


def _split_proto(value, n: int, what: str):
    """Split a DataProto (pad to a multiple of n) or a DataProtoFuture (lazily)."""
    if isinstance(value, DataProto):
        padded, pad = pad_dataproto_to_divisor(value, n)
        return padded.chunk(n), pad
    if isinstance(value, DataProtoFuture):
        return [_FutureShare(value, r, n) for r in range(n)], 0
    raise TypeError(f"{what}: expected a DataProto or DataProtoFuture; found {type(value).__name__}")


def dispatch_dp_compute_data_proto(wg, *args, **kwargs):
    """Chunk every DataProto argument across ranks. A batch that does not divide by the
    world size is padded by repeating rows from its start; the padding is removed from
    the collected result."""
    n = _world(wg)
    pads = set()
    split_args = []
    for i, a in enumerate(args):
        parts, pad = _split_proto(a, n, f"argument {i}")
        split_args.append(parts)
        pads.add(pad)
    split_kwargs = {}
    for k, v in kwargs.items():
        parts, pad = _split_proto(v, n, f"argument {k!r}")
        split_kwargs[k] = parts
        pads.add(pad)
    if len(pads) > 1:
        raise ValueError(f"DP_COMPUTE_PROTO: DataProto arguments of different lengths need "
                         f"different padding {sorted(pads)}; pass batches of one length")
    pad = pads.pop() if pads else 0
    if pad:
        split_kwargs[PADDING_KWARG] = pad
    return tuple(split_args), split_kwargs


def dispatch_dp_compute_data_proto_with_func(wg, func, *args, **kwargs):
    """Like DP_COMPUTE_PROTO, with a leading function (or any value) sent to every rank."""
    if not callable(func):
        raise TypeError(f"DP_COMPUTE_PROTO_WITH_FUNC: first argument must be callable; found "
                        f"{type(func).__name__}")
    split_args, split_kwargs = dispatch_dp_compute_data_proto(wg, *args, **kwargs)
    return ([func] * _world(wg), *split_args), split_kwargs


def collect_dp_compute_data_proto(wg, outputs):
    """Concatenate per-rank DataProtos (refs become one DataProtoFuture)."""
    import ray

    if outputs and all(isinstance(o, ray.ObjectRef) for o in outputs):
        return DataProtoFuture(collect_fn=DataProto.concat, futures=list(outputs))
    for rank, o in enumerate(outputs):
        if not isinstance(o, DataProto):
            raise TypeError(f"DP_COMPUTE_PROTO: rank {rank} returned {type(o).__name__}, "
                            f"expected a DataProto")
    return DataProto.concat(outputs)


def dispatch_rank_zero(wg, *args, **kwargs):
    return tuple([a] for a in args), {k: [v] for k, v in kwargs.items()}


def collect_rank_zero(wg, outputs):
    return outputs[0]


# ------------------------------------------------------------------ nd meshes


def make_nd_compute_dataproto_dispatch_fn(mesh_name: str) -> dict:
    """Dispatch/collect for a worker group laid out as an nd mesh (dp x tp x pp ...).

    Each worker registers its place with ``Worker._register_dispatch_collect_info(mesh_name,
    dp_rank, is_collect)``. The batch is chunked into ``dp_size`` parts; every rank of a dp
    group (all its tp/pp ranks) receives that group's chunk; only collect ranks' outputs
    (one per dp group, in dp order) are merged.
    """

    def dispatch(wg, *args, **kwargs):
        dp_ranks = wg._query_dispatch_info(mesh_name)
        dp_size = max(dp_ranks) + 1
        pads = set()

        def expand(value, what):
            parts, pad = _split_proto(value, dp_size, what)
            pads.add(pad)
            return [parts[dp_ranks[r]] for r in range(wg.world_size)]

        split_args = tuple(expand(a, f"argument {i}") for i, a in enumerate(args))
        split_kwargs = {k: expand(v, f"argument {k!r}") for k, v in kwargs.items()}
        pad = max(pads) if pads else 0
        if pad:
            split_kwargs[PADDING_KWARG] = pad
        return split_args, split_kwargs

    def collect(wg, outputs):
        flags = wg._query_collect_info(mesh_name)
        dp_ranks = wg._query_dispatch_info(mesh_name)
        chosen = sorted((dp_ranks[r], out) for r, out in enumerate(outputs) if flags[r])
        return collect_dp_compute_data_proto(wg, [out for _, out in chosen])

    return {"dispatch_fn": dispatch, "collect_fn": collect}


for _mode, _d, _c in [
    (Dispatch.RANK_ZERO, dispatch_rank_zero, collect_rank_zero),
    (Dispatch.ONE_TO_ALL, dispatch_one_to_all, collect_all_to_all),
    (Dispatch.ALL_TO_ALL, dispatch_all_to_all, collect_all_to_all),
    (Dispatch.DP_COMPUTE, dispatch_dp_compute, collect_all_to_all),
    (Dispatch.DP_COMPUTE_PROTO, dispatch_dp_compute_data_proto, collect_dp_compute_data_proto),
    (Dispatch.DP_COMPUTE_PROTO_WITH_FUNC, dispatch_dp_compute_data_proto_with_func,
     collect_dp_compute_data_proto),
    (Dispatch.DP_COMPUTE_METRIC, dispatch_dp_compute_data_proto, collect_all_to_all),
    (Dispatch.DIRECT_ROLLOUT_METHOD, dispatch_one_to_all, collect_all_to_all),
]:
    register_dispatch_mode(_mode.value, _d, _c)
