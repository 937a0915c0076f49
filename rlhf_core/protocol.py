"""DataProto: the data contract between the controller and its workers.

A :class:`DataProto` holds one batch of samples in three aligned layers:

* ``batch``: a :class:`tensordict.TensorDict` with exactly one batch dimension
  (``input_ids``, ``attention_mask``, ``old_log_probs``, ``advantages``, ...);
* ``non_tensor_batch``: ``{name: np.ndarray}`` whose first axis is the same batch axis
  (``uid``, raw prompts, ground truths, data sources, reward extras, ...);
* ``meta_info``: a dict describing the whole batch (temperature, global step, metrics).

The invariant guarded by :meth:`DataProto.check_consistency` is that every column
describes the same rows. Method names and semantics follow verl's DataProto so that
verl code ports; unlike verl, every docstring says whether the method copies or mutates,
and the wire format is one, pickle-free format (see :meth:`DataProto.__reduce__`).

Copy semantics, in short:

==================  ==========================================================
works in place      ``union``, ``reorder``, ``rename``, ``padding``, ``pop``
                    (removes from self), ``to``, ``meta_info`` edits
returns views       ``slice``, ``__getitem__`` with a slice, ``select``
                    (unless ``deepcopy=True``), ``chunk``/``split`` (tensor
                    chunks are views of self)
returns copies      ``repeat``, ``sample_level_repeat``, ``select_idxs``,
                    ``__getitem__`` with indices/mask, ``concat``,
                    ``pad_dataproto_to_divisor``, wire round trips
==================  ==========================================================
"""

from __future__ import annotations

import copy
import json
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch


def _import_tensordict():
    """Import tensordict without importing ``torch._dynamo``. At import, tensordict marks a
    few functions with ``torch.compiler.allow_in_graph`` / ``assume_constant_result``,
    which import dynamo: ~1.3 s on every start of a controller (one per Kubeflow
    iteration), which never compiles. While tensordict loads, the markers are the identity
    (eager behaviour is the same); a process that has dynamo loaded already gets
    tensordict's own marking."""
    import sys

    if "tensordict" in sys.modules or "torch._dynamo" in sys.modules:
        import tensordict
        return tensordict
    import torch.compiler

    markers = {name: getattr(torch.compiler, name) for name in ("allow_in_graph", "assume_constant_result")}
    for name in markers:
        setattr(torch.compiler, name, lambda fn: fn)
    try:
        import tensordict
    finally:
        for name, marker in markers.items():
            setattr(torch.compiler, name, marker)
    return tensordict


_td = _import_tensordict()
NonTensorData, NonTensorStack, TensorDict = _td.NonTensorData, _td.NonTensorStack, _td.TensorDict

from rlhf_core.dtypes import RAW_BITS

__all__ = [
    "DataProto",
    "DataProtoItem",
    "DataProtoFuture",
    "DataProtoError",
    "BatchSizeMismatchError",
    "UnionConflictError",
    "ChunkSizeError",
    "DataProtoTypeError",
    "UnsupportedObjectError",
    "union_tensor_dict",
    "union_numpy_dict",
    "pad_dataproto_to_divisor",
    "unpad_dataproto",
    "AUTO_PADDING_KEY",
    "DataProtoConfig",
    "MissingKeyError",
    "object_column",
    "fold_batch_dim",
    "unfold_batch_dim",
    "union_two_dict",
    "list_of_dict_to_dict_of_list",
    "collate_fn",
]

#: meta_info key that, when true, lets ``chunk`` split a batch that does not divide
#: evenly. Same key as verl so ported code that sets it keeps working.
AUTO_PADDING_KEY = "_verl_auto_padding"


class DataProtoConfig:
    """Process-wide DataProto settings (verl's name). ``auto_padding``: every batch may
    be chunked unevenly, as if each had ``meta_info[AUTO_PADDING_KEY] = True``."""

    auto_padding: bool = False

#: Version of the wire format. Bumped only on incompatible changes; never chosen at
#: run time, so every node produces and expects the same bytes.
WIRE_VERSION = 1


# --------------------------------------------------------------------------- errors


class DataProtoError(ValueError, AssertionError):
    """Base class of every error this module raises about a batch's contents. It is an
    ``AssertionError`` too: verl signals these misuses with ``assert``, and code written
    against verl that catches ``AssertionError`` must still catch ours."""


class BatchSizeMismatchError(DataProtoError):
    """Two columns of one batch describe different numbers of rows."""


class UnionConflictError(DataProtoError):
    """``union`` found the same key on both sides with different contents."""


class ChunkSizeError(DataProtoError):
    """A batch cannot be split into the requested number of equal chunks."""


class DataProtoTypeError(DataProtoError, TypeError):
    """A field has the wrong Python/numpy/torch type."""


class UnsupportedObjectError(DataProtoTypeError):
    """An object column or meta value holds a type the pickle-free wire cannot carry."""


class MissingKeyError(DataProtoError, KeyError):
    """A named key is not in the batch (a ``KeyError`` and, as in verl, an assertion)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


# --------------------------------------------------------------------- module helpers


def object_column(values) -> np.ndarray:
    """A 1-D object array holding ``values`` one per row. Unlike ``np.array(values,
    dtype=object)``, equal-length lists stay list cells instead of becoming a 2-D array."""
    values = list(values)
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"torch.Tensor(shape={tuple(value.shape)}, dtype={value.dtype})"
    if isinstance(value, np.ndarray):
        return f"np.ndarray(shape={value.shape}, dtype={value.dtype})"
    return type(value).__name__


def _first_difference(a: np.ndarray | torch.Tensor, b: np.ndarray | torch.Tensor) -> str:
    """A short human description of where two same-named columns disagree."""
    if tuple(a.shape) != tuple(b.shape):
        return f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}"
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype:
            return f"dtypes differ: {a.dtype} vs {b.dtype}"
        neq = (a != b).reshape(a.shape[0], -1).any(dim=1) if a.ndim else (a != b).reshape(1)
        row = int(torch.nonzero(neq)[0, 0]) if neq.any() else 0
        return f"first differing row {row}: {a[row].tolist()!r} vs {b[row].tolist()!r}"
    flat_a, flat_b = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
    for row in range(a.shape[0]):
        if not _objects_equal(flat_a[row], flat_b[row]):
            return f"first differing row {row}: {a[row]!r} vs {b[row]!r}"
    return "contents differ"


def _objects_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal shape, dtype kind and contents; NaN equals NaN (a column compared with
    itself after a round trip is equal), nested lists/dicts/arrays compared deeply."""
    if a.shape != b.shape or (a.dtype == object) != (b.dtype == object):
        return False
    if a.dtype != object:
        if a.dtype != b.dtype:
            return False
        nan_ok = a.dtype.kind in "fc"
        return bool(np.array_equal(a, b, equal_nan=nan_ok))
    try:
        if a.tolist() == b.tolist():  # fast path: element ==, nested lists/dicts included
            return True
    except (ValueError, TypeError, RecursionError):
        pass
    return _deep_equal(a, b, set())


def _deep_equal(x: Any, y: Any, seen: set) -> bool:
    """Structural equality with NaN == NaN, safe on self-referencing containers (a pair
    already being compared counts as equal; its other elements decide)."""
    if x is y:
        return True
    if isinstance(x, float) and isinstance(y, float) and x != x and y != y:
        return True
    containers = (list, tuple, dict, np.ndarray)
    if isinstance(x, containers) and isinstance(y, containers):
        pair = (id(x), id(y))
        if pair in seen:
            return True
        seen.add(pair)
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            x, y = np.asarray(x, dtype=object), np.asarray(y, dtype=object)
            return x.shape == y.shape and all(_deep_equal(u, v, seen) for u, v in zip(x.ravel(), y.ravel()))
        if isinstance(x, dict) or isinstance(y, dict):
            return (isinstance(x, dict) and isinstance(y, dict) and x.keys() == y.keys()
                    and all(_deep_equal(x[k], y[k], seen) for k in x))
        return len(x) == len(y) and all(_deep_equal(u, v, seen) for u, v in zip(x, y))
    try:
        return bool(x == y)
    except Exception:
        return False


def _tensors_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal`` semantics (NaN != NaN); CPU tensors compare through numpy views,
    which measured ~2x faster for the large int64 overlaps that ``union`` checks."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype in _BITS_VIEW:  # bit views would call -0.0 != 0.0 and NaN == NaN
        return torch.equal(a, b)
    x, y = _numpy_view(a), _numpy_view(b)
    if x is None or y is None:
        return torch.equal(a, b)
    return bool(np.array_equal(x, y))


def union_tensor_dict(tensor_dict1: TensorDict, tensor_dict2: TensorDict) -> TensorDict:
    """Add the keys of ``tensor_dict2`` to ``tensor_dict1`` (in place) and return it.

    Keys present on both sides must hold equal tensors; otherwise
    :class:`UnionConflictError` names the key and the first differing row. Batch sizes
    must agree (:class:`BatchSizeMismatchError`).
    """
    if tensor_dict1.batch_size != tensor_dict2.batch_size:
        raise BatchSizeMismatchError(
            f"union: batch sizes differ: left has {tuple(tensor_dict1.batch_size)}, "
            f"right has {tuple(tensor_dict2.batch_size)}"
        )
    for key, value in tensor_dict2.items():
        if key in tensor_dict1.keys():
            mine = tensor_dict1.get(key)
            if mine is not value and not _tensors_equal(mine, value):
                raise UnionConflictError(
                    f"union: key {key!r} is in both batches with different values "
                    f"({_first_difference(mine, value)})"
                )
        else:
            tensor_dict1.set(key, value)
    return tensor_dict1


def union_numpy_dict(tensor_dict1: dict[str, np.ndarray],
                     tensor_dict2: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Add the columns of ``tensor_dict2`` to ``tensor_dict1`` (in place) and return it.

    Columns present on both sides must be equal element by element; otherwise
    :class:`UnionConflictError` names the column and the first differing row.
    """
    for key, value in tensor_dict2.items():
        if key in tensor_dict1:
            mine = tensor_dict1[key]
            if mine is not value and not _objects_equal(mine, value):
                raise UnionConflictError(
                    f"union: `{key}` in tensor_dict1 and tensor_dict2 are not the same object. The non-tensor "
                    f"column {key!r} is in both batches with different values ({_first_difference(mine, value)})"
                )
        else:
            tensor_dict1[key] = value
    return tensor_dict1


def _merge_meta(left: dict, right: dict) -> dict:
    """Union of two meta dicts; a key on both sides must hold equal values."""
    for key, value in right.items():
        if key in left:
            mine = left[key]
            same = mine is value
            if not same:
                try:
                    same = bool(mine == value)
                except Exception:  # tensors/arrays: elementwise ==
                    same = False
            if not same:
                raise UnionConflictError(
                    f"union: meta_info key {key!r} differs: {mine!r} vs {value!r}"
                )
        else:
            left[key] = value
    return left


def _merge_metrics(metas: Sequence[dict]) -> dict:
    """Concatenate per-chunk ``metrics`` into one dict of lists, in chunk order.

    Each chunk's ``meta_info["metrics"]`` is ``{name: value}``, ``{name: [values]}`` or
    a list of such dicts (several reports from one worker); None is skipped. The merged
    value is the list of every value, in order.
    """
    merged: dict[str, list] = {}
    for meta in metas:
        reports = meta.get("metrics")
        if reports is None:
            continue
        for report in reports if isinstance(reports, (list, tuple)) else [reports]:
            for name, value in (report or {}).items():
                bucket = merged.setdefault(name, [])
                if isinstance(value, (list, tuple)):
                    bucket.extend(value)
                else:
                    bucket.append(value)
    return merged


def _same_value(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:  # tensors/arrays: elementwise ==
        return _deep_equal(a, b, set())


def _check_index_tensor(idxs: Any, length: int, where: str) -> torch.Tensor:
    """Turn int/bool indices of any accepted form into a 1-D int64 tensor."""
    if isinstance(idxs, np.ndarray):
        idxs = torch.from_numpy(idxs)
    elif isinstance(idxs, (list, tuple, range)):
        idxs = torch.as_tensor(list(idxs)) if len(idxs) else torch.zeros(0, dtype=torch.int64)
    elif not isinstance(idxs, torch.Tensor):
        raise DataProtoTypeError(
            f"{where}: indices must be a list, range, np.ndarray or torch.Tensor of int or "
            f"bool; found {_describe(idxs)}"
        )
    idxs = idxs.reshape(-1).cpu()
    if idxs.dtype == torch.bool:
        if idxs.numel() != length:
            raise BatchSizeMismatchError(
                f"{where}: boolean mask has {idxs.numel()} entries but the batch has "
                f"{length} rows"
            )
        return torch.nonzero(idxs).reshape(-1)
    if idxs.dtype.is_floating_point or idxs.dtype.is_complex:
        raise DataProtoTypeError(f"{where}: indices must be int or bool; found dtype {idxs.dtype}")
    idxs = idxs.to(torch.int64)
    if idxs.numel() and (int(idxs.max()) >= length or int(idxs.min()) < -length):
        bad = int(idxs.max()) if int(idxs.max()) >= length else int(idxs.min())
        raise IndexError(f"{where}: index {bad} is out of range for a batch of {length} rows")
    return idxs



# Row operations on CPU tensors go through numpy views: np.repeat / np.take /
# np.concatenate move the same bytes as torch's kernels but measured 2-4x faster here
# (benchmarks/dataproto_ops.py), mostly because torch's repeat/index kernels are slow
# for bool and first-touch large outputs. Anything numpy cannot view (GPU tensors,
# tensors that need autograd) takes the torch path, with the same result.
_BITS_VIEW = {dtype: bits for dtype, (bits, _) in RAW_BITS.items()}


def _numpy_view(t: torch.Tensor) -> np.ndarray | None:
    if t.device.type != "cpu" or t.requires_grad or t.ndim == 0:
        return None
    bits = _BITS_VIEW.get(t.dtype)
    try:
        return (t.view(bits) if bits is not None else t).numpy()
    except (TypeError, RuntimeError):  # dtypes numpy lacks (fp8, complex32, ...)
        return None


def _from_numpy_like(array: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    out = torch.from_numpy(array)
    return out.view(like.dtype) if out.dtype != like.dtype else out


def _repeat_rows(t: torch.Tensor, times: int, interleave: bool) -> torch.Tensor:
    a = _numpy_view(t)
    if a is None:
        if interleave:
            return t.repeat_interleave(times, dim=0)
        return t.repeat(times, *([1] * (t.ndim - 1)))
    out = np.repeat(a, times, axis=0) if interleave else np.tile(a, (times,) + (1,) * (a.ndim - 1))
    return _from_numpy_like(out, t)


def _take_rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    a = _numpy_view(t)
    if a is None:
        return t.index_select(0, index.to(t.device))
    return _from_numpy_like(np.take(a, index.numpy(), axis=0), t)


def _cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    arrays = [_numpy_view(p) for p in parts]
    if any(a is None for a in arrays) or len({p.dtype for p in parts}) != 1:
        return torch.cat(parts, dim=0)
    return _from_numpy_like(np.concatenate(arrays, axis=0), parts[0])


# ----------------------------------------------------------------- pickle-free wire


_JSON_SCALARS = (str, bool, int, float, type(None))


def _to_json_value(value: Any, where: str) -> Any:
    """Check (and normalise numpy scalars in) one value bound for the JSON wire."""
    if isinstance(value, _JSON_SCALARS):
        return value
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return value.item()
    if isinstance(value, list):
        return [_to_json_value(v, where) for v in value]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise UnsupportedObjectError(
                    f"{where}: dict keys must be str to cross the wire; found key {k!r} "
                    f"of type {type(k).__name__}"
                )
            out[k] = _to_json_value(v, where)
        return out
    raise UnsupportedObjectError(
        f"{where}: values must be str, int, float, bool, None, list or dict (pickle-free "
        f"wire); found {type(value).__module__}.{type(value).__qualname__}. Convert it "
        f"(e.g. tuple -> list, tensor -> list) before putting it in the batch."
    )


def _object_column_to_wire(name: str, column: np.ndarray) -> tuple:
    if column.dtype != object:
        # numeric / bool / fixed-width unicode arrays travel as raw buffers.
        return ("raw", column if column.flags.c_contiguous else np.ascontiguousarray(column))
    flat = column.ravel().tolist()
    if not all(type(v) is str for v in flat):  # fast path for the common all-str column
        flat = [_to_json_value(v, f"non_tensor_batch[{name!r}]") for v in flat]
    payload = json.dumps(flat, ensure_ascii=False, allow_nan=True).encode("utf-8")
    return ("json", np.frombuffer(payload, dtype=np.uint8), column.shape)


def _object_column_from_wire(entry: tuple) -> np.ndarray:
    kind = entry[0]
    if kind == "raw":
        return entry[1]
    if kind == "json":
        return object_column(json.loads(entry[1].tobytes().decode("utf-8"))).reshape(entry[2])
    raise DataProtoError(f"wire: unknown non-tensor column encoding {kind!r}")


def _tensor_to_wire(t: torch.Tensor) -> tuple[str, np.ndarray]:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    dtype = str(t.dtype).removeprefix("torch.")
    if t.dtype in RAW_BITS:  # numpy has no bf16/fp8: their bits travel, the dtype beside them
        return dtype, t.view(RAW_BITS[t.dtype][0]).numpy()
    return dtype, t.numpy()


def _tensor_from_wire(dtype: str, array: np.ndarray) -> torch.Tensor:
    # Zero-copy: the tensor is a view of the received buffer. Under Ray that buffer is
    # the object's memory in the node's object store; every dispatch sends each rank
    # its own object, so in-place edits stay private to the receiving task. (Tensors
    # obtained by ray.get of a ref that is shared by several readers must be cloned
    # before in-place edits, exactly as with numpy arrays from ray.get.) Copying here
    # would cost one full pass over fresh memory per hop (benchmarks/dispatch.py).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        t = torch.from_numpy(array)
    target = getattr(torch, dtype)
    return t if t.dtype == target else t.view(target)


def _from_wire(state: dict) -> "DataProto":
    version = state.get("wire_version")
    if version != WIRE_VERSION:
        raise DataProtoError(
            f"wire: DataProto wire_version {version!r} is not supported by this build "
            f"(expected {WIRE_VERSION}); run the same rlhf_core version on every node"
        )
    batch = None
    if state["batch"] is not None:
        tensors = {k: _tensor_from_wire(d, a) for k, (d, a) in state["batch"].items()}
        batch = TensorDict(tensors, batch_size=state["batch_size"])
    non_tensor = {k: _object_column_from_wire(e) for k, e in state["non_tensor_batch"].items()}
    meta = json.loads(state["meta_info"]) if state["meta_info"] else {}
    return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)


# ------------------------------------------------------------------------ DataProto


@dataclass
class DataProtoItem:
    """One row of a DataProto: ``batch`` is a 0-dim TensorDict view, ``non_tensor_batch``
    holds that row's object values, ``meta_info`` is the parent's dict (shared)."""

    batch: TensorDict | None = None
    non_tensor_batch: dict = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)


@dataclass
class DataProto:
    """A batch of samples: tensors, aligned object columns and batch-level meta.

    Build one with :meth:`from_single_dict` or :meth:`from_dict`; the constructor checks
    consistency. All columns share the first (batch) axis.
    """

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.non_tensor_batch is None:
            self.non_tensor_batch = {}
        if self.meta_info is None:
            self.meta_info = {}
        self.check_consistency()

    # ---------------------------------------------------------------- construction

    @classmethod
    def from_single_dict(cls, data: dict[str, torch.Tensor | np.ndarray],
                         meta_info: dict | None = None, auto_padding: bool = False) -> "DataProto":
        """Split one flat dict into tensors (-> ``batch``) and numpy arrays (-> object
        columns). Values are not copied. Any other value type is a DataProtoTypeError."""
        for key, value in data.items():
            if not isinstance(value, (torch.Tensor, np.ndarray)):
                raise DataProtoTypeError(f"from_single_dict: field {key!r} must be a torch.Tensor or "
                                         f"np.ndarray; found {_describe(value)}")
        return cls.from_dict({k: v for k, v in data.items() if isinstance(v, torch.Tensor)},
                             {k: v for k, v in data.items() if isinstance(v, np.ndarray)},
                             meta_info, auto_padding=auto_padding)

    @classmethod
    def from_dict(cls, tensors: dict[str, torch.Tensor] | None = None,
                  non_tensors: dict[str, np.ndarray] | None = None,
                  meta_info: dict | None = None, num_batch_dims: int = 1,
                  auto_padding: bool = False) -> "DataProto":
        """Build from tensors and object columns (not copied).

        The batch size is read from the first tensor's leading axis; every other column
        must match it (BatchSizeMismatchError names the field and both sizes).
        """
        if num_batch_dims != 1:
            raise DataProtoError(
                f"from_dict: num_batch_dims must be 1 (one batch axis); found {num_batch_dims}"
            )
        tensors = dict(tensors or {})
        # plain lists are accepted as verl accepts them: np.array(values, dtype=object),
        # so equal-length rows become a 2-D column (use object_column to keep lists whole)
        non_tensors = {k: v if isinstance(v, np.ndarray) else np.array(v, dtype=object)
                       for k, v in (non_tensors or {}).items()}
        meta_info = dict(meta_info or {})
        batch = None
        if tensors:
            size, pivot = None, None
            for key, value in tensors.items():
                if not isinstance(value, torch.Tensor):
                    raise DataProtoTypeError(
                        f"from_dict: tensor field {key!r} must be a torch.Tensor; found "
                        f"{_describe(value)}"
                    )
                if value.ndim == 0:
                    raise DataProtoTypeError(
                        f"from_dict: tensor field {key!r} is a 0-dim tensor; it needs a "
                        f"leading batch axis"
                    )
                if size is None:
                    size, pivot = value.shape[0], key
                elif value.shape[0] != size:
                    raise BatchSizeMismatchError(
                        f"from_dict: tensor field {key!r} has {value.shape[0]} rows but "
                        f"{pivot!r} has {size}"
                    )
            batch = TensorDict(tensors, batch_size=[size])
        if auto_padding:
            meta_info[AUTO_PADDING_KEY] = True
        return cls(batch=batch, non_tensor_batch=non_tensors, meta_info=meta_info)

    @classmethod
    def from_tensordict(cls, tensor_dict: TensorDict, meta_info: dict | None = None,
                        num_batch_dims: int = 1) -> "DataProto":
        """Inverse of :meth:`to_tensordict`: NonTensorStack entries become object
        columns, NonTensorData entries become meta_info. Tensors are not copied."""
        if len(tensor_dict.batch_size) != num_batch_dims or num_batch_dims != 1:
            raise DataProtoError(
                f"from_tensordict: expected a TensorDict with 1 batch dim; found batch_size "
                f"{tuple(tensor_dict.batch_size)}"
            )
        tensors, non_tensors, meta = {}, {}, dict(meta_info or {})
        for key in tensor_dict.keys():
            value = tensor_dict.get(key)
            if isinstance(value, NonTensorStack):
                non_tensors[key] = np.array(value.tolist(), dtype=object)
            elif isinstance(value, NonTensorData):
                meta[key] = value.data
            elif isinstance(value, torch.Tensor):
                tensors[key] = value
            else:
                raise DataProtoTypeError(
                    f"from_tensordict: entry {key!r} must be a tensor, NonTensorStack or "
                    f"NonTensorData; found {_describe(value)}"
                )
        batch = TensorDict(tensors, batch_size=tensor_dict.batch_size) if tensors else None
        return cls(batch=batch, non_tensor_batch=non_tensors, meta_info=meta)

    def to_tensordict(self) -> TensorDict:
        """One TensorDict holding everything (tensors shared, not copied): object columns
        as ``NonTensorStack``, each meta_info entry as ``NonTensorData``."""
        size = len(self)
        out = TensorDict({}, batch_size=[size])
        if self.batch is not None:
            for key, value in self.batch.items():
                out.set(key, value)
        for key, column in self.non_tensor_batch.items():
            if key in out.keys():
                raise UnionConflictError(f"to_tensordict: {key!r} is both a tensor and a non-tensor column")
            # rows as plain Python values (a 2-D column's row is a list), as verl does
            rows = column.tolist() if column.dtype != object or column.ndim > 1 else list(column)
            out.set(key, NonTensorStack(*[NonTensorData(r) for r in rows], batch_size=[size]))
        for key, value in self.meta_info.items():
            if key in out.keys():
                raise UnionConflictError(
                    f"to_tensordict: meta_info key {key!r} collides with a column of the "
                    f"same name"
                )
            out.set_non_tensor(key, value)
        return out

    # ---------------------------------------------------------------- invariants

    def check_consistency(self) -> None:
        """Raise unless every column has the same number of rows (and types are right).

        Checks: ``batch`` is a TensorDict with exactly one batch dim; every object column
        is a numpy array with a leading axis equal to the batch size; ``meta_info`` is a
        dict. Errors name the offending field and both sizes.
        """
        if self.batch is not None:
            if not isinstance(self.batch, TensorDict):
                raise DataProtoTypeError(
                    f"batch must be a tensordict.TensorDict or None; found {_describe(self.batch)}"
                )
            if len(self.batch.batch_size) != 1:
                raise DataProtoError(
                    f"batch must have exactly one batch dim; found batch_size "
                    f"{tuple(self.batch.batch_size)}"
                )
        if not isinstance(self.non_tensor_batch, dict):
            raise DataProtoTypeError(
                f"non_tensor_batch must be a dict of np.ndarray; found {_describe(self.non_tensor_batch)}"
            )
        if not isinstance(self.meta_info, dict):
            raise DataProtoTypeError(f"meta_info must be a dict; found {_describe(self.meta_info)}")
        size = self.batch.batch_size[0] if self.batch is not None else None
        pivot = "batch"
        for key, value in self.non_tensor_batch.items():
            if not isinstance(value, np.ndarray):
                raise DataProtoTypeError(
                    f"non_tensor_batch[{key!r}] must be a np.ndarray; found {_describe(value)}"
                )
            if value.ndim == 0:
                raise DataProtoTypeError(
                    f"non_tensor_batch[{key!r}] is a 0-dim array; it needs a leading batch axis"
                )
            if size is None:
                size, pivot = value.shape[0], f"non_tensor_batch[{key!r}]"
            elif value.shape[0] != size:
                raise BatchSizeMismatchError(
                    f"non_tensor_batch[{key!r}] has {value.shape[0]} rows but {pivot} has "
                    f"{size}"
                )

    def __len__(self) -> int:
        if self.batch is not None:
            return int(self.batch.batch_size[0])
        for value in self.non_tensor_batch.values():
            return int(value.shape[0])
        return 0

    def is_padding_enabled(self) -> bool:
        """Whether ``chunk`` may split this batch unevenly (``meta_info[AUTO_PADDING_KEY]``,
        or ``DataProtoConfig.auto_padding`` for every batch)."""
        return bool(self.meta_info.get(AUTO_PADDING_KEY, False)) or DataProtoConfig.auto_padding

    # ---------------------------------------------------------------- indexing

    def __getitem__(self, item: Any) -> "DataProto | DataProtoItem":
        """``dp[i]`` -> DataProtoItem (views); ``dp[a:b]`` -> view (see :meth:`slice`);
        ``dp[list|array|tensor]`` of ints or a bool mask -> copy (see :meth:`select_idxs`)."""
        if isinstance(item, slice):
            return self.slice(item.start, item.stop, item.step)
        if isinstance(item, (int, np.integer)) and not isinstance(item, (bool, np.bool_)):
            n = len(self)
            if not -n <= int(item) < n:
                raise IndexError(f"index {int(item)} is out of range for a batch of {n} rows")
            i = int(item) % n
            batch = self.batch[i] if self.batch is not None else None
            row = {k: v[i] for k, v in self.non_tensor_batch.items()}
            return DataProtoItem(batch=batch, non_tensor_batch=row, meta_info=self.meta_info)
        if isinstance(item, (list, tuple, range, np.ndarray, torch.Tensor)):
            return self.select_idxs(item)
        raise DataProtoTypeError(
            f"DataProto indices must be int, slice, list, np.ndarray, torch.Tensor or a bool "
            f"mask; found {_describe(item)}"
        )

    def __iter__(self) -> Iterator[DataProtoItem]:
        for i in range(len(self)):
            yield self[i]

    def slice(self, start: int | None = None, end: int | None = None,
              step: int | None = None) -> "DataProto":
        """Rows ``start:end:step`` as a view: tensors and object columns share memory with
        self; meta_info is a shallow copy."""
        s = slice(start, end, step)
        batch = self.batch[s] if self.batch is not None else None
        non_tensor = {k: v[s] for k, v in self.non_tensor_batch.items()}
        return type(self)(batch=batch, non_tensor_batch=non_tensor, meta_info=dict(self.meta_info))

    def select_idxs(self, idxs: Any) -> "DataProto":
        """Rows at ``idxs`` (ints, possibly repeated, or a bool mask of len(self)) as a
        copy; meta_info is a shallow copy."""
        index = _check_index_tensor(idxs, len(self), "select_idxs")
        np_index = index.numpy()
        batch = None
        if self.batch is not None:
            batch = TensorDict({k: _take_rows(v, index) for k, v in self.batch.items()},
                               batch_size=[index.numel()])
        non_tensor = {k: v[np_index] for k, v in self.non_tensor_batch.items()}
        return type(self)(batch=batch, non_tensor_batch=non_tensor, meta_info=dict(self.meta_info))

    def select(self, batch_keys: Sequence[str] | None = None,
               non_tensor_batch_keys: Sequence[str] | None = None,
               meta_info_keys: Sequence[str] | None = None,
               deepcopy: bool = False) -> "DataProto":
        """A DataProto with only the named keys (None = all of that layer).

        Without ``deepcopy`` the result shares tensors and arrays with self; with it,
        everything is copied. Unknown keys raise KeyError naming the key and the choices.
        """
        def pick(source: dict, keys, layer: str, strict: bool) -> dict:
            if keys is None:
                return dict(source)
            missing = [k for k in keys if k not in source]
            if missing and strict:
                raise MissingKeyError(f"select: {layer} has no key(s) {missing}; available: {sorted(source)}")
            return {k: source[k] for k in keys if k in source}

        batch = None
        if self.batch is not None:
            tensors = pick(dict(self.batch.items()), batch_keys, "batch", strict=True)
            batch = TensorDict(tensors, batch_size=self.batch.batch_size)
        elif batch_keys:
            raise MissingKeyError(f"select: batch is empty; cannot select {list(batch_keys)}")
        # as in verl: absent object columns and meta keys are skipped, absent tensors are not
        non_tensor = pick(self.non_tensor_batch, non_tensor_batch_keys, "non_tensor_batch", strict=False)
        meta = pick(self.meta_info, meta_info_keys, "meta_info", strict=False)
        if deepcopy:
            batch = batch.clone() if batch is not None else None
            non_tensor = {k: v.copy() for k, v in non_tensor.items()}
            meta = copy.deepcopy(meta)
        return type(self)(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)

    def pop(self, batch_keys: Sequence[str] | None = None,
            non_tensor_batch_keys: Sequence[str] | None = None,
            meta_info_keys: Sequence[str] | None = None) -> "DataProto":
        """Remove the named keys from self (in place) and return them as a new DataProto
        (the popped values are moved, not copied)."""
        batch_keys = list(batch_keys or [])
        non_tensor_batch_keys = list(non_tensor_batch_keys or [])
        meta_info_keys = list(meta_info_keys or [])
        available = set(self.batch.keys()) if self.batch is not None else set()
        for key in batch_keys:
            if key not in available:
                raise MissingKeyError(f"pop: batch has no key {key!r}; available: {sorted(available)}")
        for key in non_tensor_batch_keys:
            if key not in self.non_tensor_batch:
                raise MissingKeyError(f"pop: non_tensor_batch has no key {key!r}; available: "
                               f"{sorted(self.non_tensor_batch)}")
        for key in meta_info_keys:
            if key not in self.meta_info:
                raise MissingKeyError(f"pop: meta_info has no key {key!r}; available: "
                               f"{sorted(self.meta_info)}")
        tensors = {k: self.batch.pop(k) for k in batch_keys}
        non_tensor = {k: self.non_tensor_batch.pop(k) for k in non_tensor_batch_keys}
        meta = {k: self.meta_info.pop(k) for k in meta_info_keys}
        batch = None
        if tensors:
            batch = TensorDict(tensors, batch_size=self.batch.batch_size)
        elif not non_tensor and self.batch is not None:
            batch = TensorDict({}, batch_size=self.batch.batch_size)
        return type(self)(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)

    def rename(self, old_keys: str | Sequence[str] | None = None,
               new_keys: str | Sequence[str] | None = None) -> "DataProto":
        """Rename tensor keys in place; returns self."""
        old = [old_keys] if isinstance(old_keys, str) else list(old_keys or [])
        new = [new_keys] if isinstance(new_keys, str) else list(new_keys or [])
        if len(old) != len(new):
            raise DataProtoError(
                f"rename: old_keys has {len(old)} names but new_keys has {len(new)}"
            )
        if self.batch is None and old:
            raise KeyError(f"rename: batch is empty; cannot rename {old}")
        for o, n in zip(old, new):
            if o not in self.batch.keys():
                raise KeyError(f"rename: batch has no key {o!r}; available: "
                               f"{sorted(self.batch.keys())}")
            if n in self.batch.keys() and n != o:
                raise KeyError(f"rename: target key {n!r} already exists in batch")
        for o, n in zip(old, new):
            self.batch.rename_key_(o, n)
        return self

    # ---------------------------------------------------------------- combination

    def union(self, other: "DataProto") -> "DataProto":
        """Add other's tensors, object columns and meta to self, in place; returns self.

        Keys on both sides must be equal (UnionConflictError names the key); batch sizes
        must match (BatchSizeMismatchError).
        """
        if len(self) != len(other) and (self.batch is not None or self.non_tensor_batch) \
                and (other.batch is not None or other.non_tensor_batch):
            raise BatchSizeMismatchError(
                f"union: left batch has {len(self)} rows, right batch has {len(other)}"
            )
        if other.batch is not None:
            if self.batch is None:
                self.batch = other.batch.clone(recurse=False)
            else:
                union_tensor_dict(self.batch, other.batch)
        union_numpy_dict(self.non_tensor_batch, other.non_tensor_batch)
        _merge_meta(self.meta_info, other.meta_info)
        self.check_consistency()
        return self

    @staticmethod
    def concat(data: Sequence["DataProto"]) -> "DataProto":
        """Concatenate batches row-wise (copy). Every part must have the same keys.

        meta_info is the union of the parts' (a key two parts hold with different values
        is a UnionConflictError), except ``meta_info["metrics"]``, which is merged across
        parts into ``{name: [values from every part, in order]}`` so that per-rank
        metrics survive a collect. The result has the first part's class.
        """
        data = list(data)
        if not data:
            raise DataProtoError("concat: got an empty list of DataProto")
        first = data[0]
        batch = None
        if first.batch is not None:
            keys = list(first.batch.keys())
            for i, part in enumerate(data[1:], start=1):
                theirs = list(part.batch.keys()) if part.batch is not None else []
                if sorted(theirs) != sorted(keys):
                    raise DataProtoError(
                        f"concat: part {i} has batch keys {sorted(theirs)} but part 0 has "
                        f"{sorted(keys)}"
                    )
            tensors = {k: _cat_rows([p.batch.get(k) for p in data]) for k in keys}
            batch = TensorDict(tensors, batch_size=[sum(len(p) for p in data)])
        non_tensor = {}
        for key in first.non_tensor_batch:
            parts = []
            for i, p in enumerate(data):
                if key not in p.non_tensor_batch:
                    raise DataProtoError(f"concat: part {i} lacks non-tensor column {key!r}")
                parts.append(p.non_tensor_batch[key])
            non_tensor[key] = np.concatenate(parts, axis=0)
        meta: dict = {}
        for part in data:
            for key, value in part.meta_info.items():
                if key == "metrics":
                    continue
                if key in meta and not _same_value(meta[key], value):
                    raise UnionConflictError(f"concat: Conflicting values for meta_info key {key!r}: "
                                             f"{meta[key]!r} vs {value!r}")
                meta.setdefault(key, value)
        metrics = _merge_metrics([p.meta_info for p in data])
        if metrics:
            meta["metrics"] = metrics
        return type(first)(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)

    def chunk(self, chunks: int) -> list["DataProto"]:
        """Split into ``chunks`` parts along the batch axis (tensor parts are views).

        When ``len(self)`` does not divide, this raises ChunkSizeError unless auto padding
        is enabled (``meta_info[AUTO_PADDING_KEY]``), in which case the parts differ in
        size by at most one row (the first ``len % chunks`` parts get the extra row).
        """
        if not isinstance(chunks, int) or chunks < 1:
            raise DataProtoError(f"chunk: chunks must be a positive int; found {chunks!r}")
        n = len(self)
        if n % chunks and not self.is_padding_enabled():
            raise ChunkSizeError(
                f"chunk: batch of {n} rows does not split into {chunks} equal chunks "
                f"({n} % {chunks} = {n % chunks}); pad with pad_dataproto_to_divisor or "
                f"set meta_info[{AUTO_PADDING_KEY!r}] = True"
            )
        base, extra = divmod(n, chunks)
        bounds, start = [], 0
        for i in range(chunks):
            stop = start + base + (1 if i < extra else 0)
            bounds.append((start, stop))
            start = stop
        return [self.slice(a, b) for a, b in bounds]

    def split(self, split_size: int) -> list["DataProto"]:
        """Consecutive parts of ``split_size`` rows (the last may be shorter); views."""
        if not isinstance(split_size, int) or split_size < 1:
            raise DataProtoError(f"split: split_size must be a positive int; found {split_size!r}")
        return [self.slice(i, i + split_size) for i in range(0, len(self), split_size)]

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> "DataProto":
        """Each row ``repeat_times`` times (copy). ``interleave=True`` gives
        ``a a b b``; False gives ``a b a b``."""
        if not isinstance(repeat_times, int) or repeat_times < 1:
            raise DataProtoError(f"repeat: repeat_times must be a positive int; found {repeat_times!r}")
        n = len(self)
        batch = None
        if self.batch is not None:
            tensors = {k: _repeat_rows(v, repeat_times, interleave) for k, v in self.batch.items()}
            batch = TensorDict(tensors, batch_size=[n * repeat_times])
        if interleave:
            non_tensor = {k: np.repeat(v, repeat_times, axis=0) for k, v in self.non_tensor_batch.items()}
        else:
            non_tensor = {k: np.tile(v, (repeat_times,) + (1,) * (v.ndim - 1))
                          for k, v in self.non_tensor_batch.items()}
        return type(self)(batch=batch, non_tensor_batch=non_tensor, meta_info=dict(self.meta_info))

    def sample_level_repeat(self, repeat_times: Sequence[int] | torch.Tensor | np.ndarray) -> "DataProto":
        """Row ``i`` repeated ``repeat_times[i]`` times, in order (copy)."""
        counts = torch.as_tensor(np.asarray(repeat_times), dtype=torch.int64).reshape(-1)
        if counts.numel() != len(self):
            raise BatchSizeMismatchError(
                f"sample_level_repeat: repeat_times has {counts.numel()} entries but the "
                f"batch has {len(self)} rows"
            )
        if counts.numel() and int(counts.min()) < 0:
            raise DataProtoError("sample_level_repeat: repeat_times must be >= 0")
        index = torch.repeat_interleave(torch.arange(len(self)), counts)
        return self.select_idxs(index)

    def reorder(self, indices: torch.Tensor | np.ndarray | Sequence[int]) -> None:
        """Permute rows in place (``self = self[indices]``)."""
        index = _check_index_tensor(indices, len(self), "reorder")
        if index.numel() != len(self):
            raise BatchSizeMismatchError(
                f"reorder: indices has {index.numel()} entries but the batch has {len(self)} rows"
            )
        reordered = self.select_idxs(index)
        self.batch = reordered.batch
        self.non_tensor_batch = reordered.non_tensor_batch

    def padding(self, padding_size: int, padding_candidate: str = "") -> None:
        """Append ``padding_size`` rows in place, copies of the first row
        (``padding_candidate="first"``) or of the last (``"last"``, the default)."""
        if padding_size == 0:
            return
        if padding_size < 0:
            raise DataProtoError(f"padding: padding_size must be >= 0; found {padding_size}")
        if len(self) == 0:
            raise DataProtoError("padding: cannot pad an empty batch (no row to copy)")
        row = 0 if padding_candidate == "first" else len(self) - 1
        pad = self.select_idxs([row] * padding_size)
        padded = DataProto.concat([self, pad])
        self.batch = padded.batch
        self.non_tensor_batch = padded.non_tensor_batch

    # ---------------------------------------------------------------- iteration / devices

    def make_iterator(self, mini_batch_size: int, epochs: int, seed: int | None = None,
                      dataloader_kwargs: dict | None = None) -> Iterator["DataProto"]:
        """Yield mini-batches of ``mini_batch_size`` rows for ``epochs`` passes (copies).

        ``dataloader_kwargs={"shuffle": True}`` shuffles each epoch with a generator
        seeded by ``seed`` (reproducible); the batch must divide by mini_batch_size.
        """
        kwargs = dict(dataloader_kwargs or {})
        shuffle = bool(kwargs.pop("shuffle", False))
        # DataLoader settings that do not change which rows a mini-batch holds here
        for harmless in ("num_workers", "pin_memory", "persistent_workers", "prefetch_factor", "drop_last"):
            kwargs.pop(harmless, None)
        if kwargs:
            raise DataProtoError(f"make_iterator: unsupported dataloader_kwargs {sorted(kwargs)}; "
                                 f"supported: ['shuffle'] (and DataLoader's worker/pinning settings, ignored)")
        n = len(self)
        if mini_batch_size < 1 or n % mini_batch_size:
            raise ChunkSizeError(
                f"make_iterator: batch of {n} rows does not split into mini-batches of "
                f"{mini_batch_size}"
            )
        generator = None  # unseeded: torch's global RNG, as a DataLoader would use
        if seed is not None:
            generator = torch.Generator()
            generator.manual_seed(seed)
        meta = dict(self.meta_info)

        def _iter():
            for _ in range(epochs):
                order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
                for start in range(0, n, mini_batch_size):
                    part = self.select_idxs(order[start:start + mini_batch_size])
                    part.meta_info = dict(meta)
                    yield part

        return _iter()

    def to(self, device: str | torch.device) -> "DataProto":
        """Move tensors to ``device`` in place; returns self."""
        if self.batch is not None:
            self.batch = self.batch.to(device)
        return self

    def get_data_info(self) -> str:
        """One line per column: name, shape, dtype (for logs)."""
        lines = [f"DataProto(len={len(self)})"]
        if self.batch is not None:
            for k, v in self.batch.items():
                lines.append(f"  batch[{k!r}]: {tuple(v.shape)} {v.dtype}")
        for k, v in self.non_tensor_batch.items():
            lines.append(f"  non_tensor_batch[{k!r}]: {v.shape} {v.dtype}")
        if self.meta_info:
            lines.append(f"  meta_info keys: {sorted(self.meta_info)}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        keys = list(self.batch.keys()) if self.batch is not None else []
        return (f"DataProto(len={len(self)}, batch={keys}, "
                f"non_tensor_batch={list(self.non_tensor_batch)}, meta_info={list(self.meta_info)})")

    def unfold_column_chunks(self, n_split: int, split_keys: Sequence[str] | None = None) -> "DataProto":
        """Each row becomes ``n_split`` rows (copy): columns named in ``split_keys`` are
        cut into ``n_split`` equal pieces along their second axis, every other column is
        repeated (e.g. a multi-turn row into its turns)."""
        split_keys = set(split_keys or [])
        if not isinstance(n_split, int) or n_split < 1:
            raise DataProtoError(f"unfold_column_chunks: n_split must be a positive int; found {n_split!r}")

        def unfold(name: str, value):
            if name in split_keys:
                if value.ndim < 2 or value.shape[1] % n_split:
                    raise ChunkSizeError(f"unfold_column_chunks: {name!r} of shape {tuple(value.shape)} does not "
                                         f"split into {n_split} pieces along axis 1")
                return value.reshape(value.shape[0] * n_split, value.shape[1] // n_split, *value.shape[2:])
            if isinstance(value, torch.Tensor):
                return torch.repeat_interleave(value, n_split, dim=0)
            return np.repeat(value, n_split, axis=0)

        rows = len(self) * n_split
        batch = None
        if self.batch is not None:
            batch = TensorDict({k: unfold(k, v) for k, v in self.batch.items()}, batch_size=[rows])
        non_tensor = {k: unfold(k, v) for k, v in self.non_tensor_batch.items()}
        return type(self)(batch=batch, non_tensor_batch=non_tensor, meta_info=dict(self.meta_info))

    def save_to_disk(self, filepath: str) -> None:
        """Write this batch to one file (overwritten if present) in the wire format: a
        numpy ``.npz`` of raw buffers plus a JSON header. Nothing is pickled."""
        wire = self.to_wire()
        arrays, header = {}, {"wire_version": wire["wire_version"], "batch_size": wire["batch_size"],
                              "meta_info": wire["meta_info"], "batch": None, "non_tensor_batch": {}}
        if wire["batch"] is not None:
            header["batch"] = {}
            for i, (key, (dtype, array)) in enumerate(wire["batch"].items()):
                arrays[f"t{i}"] = array
                header["batch"][key] = [dtype, f"t{i}"]
        for i, (key, entry) in enumerate(wire["non_tensor_batch"].items()):
            arrays[f"n{i}"] = entry[1]
            header["non_tensor_batch"][key] = [entry[0], f"n{i}", list(entry[2]) if len(entry) > 2 else None]
        arrays["header"] = np.frombuffer(json.dumps(header).encode("utf-8"), dtype=np.uint8)
        with open(filepath, "wb") as f:
            np.savez(f, **arrays)

    @staticmethod
    def load_from_disk(filepath: str) -> "DataProto":
        """Read a file written by :meth:`save_to_disk` (``allow_pickle=False``)."""
        with np.load(filepath, allow_pickle=False) as npz:
            header = json.loads(npz["header"].tobytes().decode("utf-8"))
            batch = None
            if header["batch"] is not None:
                batch = {k: (dtype, np.array(npz[name])) for k, (dtype, name) in header["batch"].items()}
            non_tensor = {}
            for key, (kind, name, shape) in header["non_tensor_batch"].items():
                array = np.array(npz[name])
                non_tensor[key] = (kind, array) if kind == "raw" else (kind, array, tuple(shape))
        return _from_wire({"wire_version": header["wire_version"], "batch": batch,
                           "batch_size": header["batch_size"], "non_tensor_batch": non_tensor,
                           "meta_info": header["meta_info"]})

    # ---------------------------------------------------------------- pickle-free wire

    def to_wire(self) -> dict:
        """The wire form: a dict of numpy buffers, strings and JSON bytes (no pickled
        payload). Tensors become numpy views of their memory (bf16/fp8 as raw bits,
        dtype recorded), object columns become JSON, meta_info becomes JSON.

        Raises UnsupportedObjectError naming the column (or meta key) and the offending
        type when something cannot be represented.
        """
        batch = None
        if self.batch is not None:
            batch = {k: _tensor_to_wire(v) for k, v in self.batch.items()}
        non_tensor = {k: _object_column_to_wire(k, v) for k, v in self.non_tensor_batch.items()}
        meta = {}
        for key, value in self.meta_info.items():
            if not isinstance(key, str):
                raise UnsupportedObjectError(f"meta_info keys must be str; found {key!r}")
            meta[key] = _to_json_value(value, f"meta_info[{key!r}]")
        return {
            "wire_version": WIRE_VERSION,
            "batch": batch,
            "batch_size": [len(self)] if self.batch is not None else None,
            "non_tensor_batch": non_tensor,
            "meta_info": json.dumps(meta, allow_nan=True) if meta else "",
        }

    @staticmethod
    def from_wire(state: dict) -> "DataProto":
        """Inverse of :meth:`to_wire`. Tensors and numeric columns are views of the
        received buffers (no copy); object columns and meta are decoded from JSON."""
        return _from_wire(state)

    def __reduce__(self):
        # Ray (and any pickler) sees only a call to _from_wire with plain containers of
        # numpy arrays: with protocol 5 the array buffers travel out of band, so tensor
        # bytes are never pickled, and nothing but JSON and raw numbers is decoded.
        return (_from_wire, (self.to_wire(),))


# ------------------------------------------------------------------ padding helpers


def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """Pad ``data`` (copy) to a multiple of ``size_divisor`` by repeating rows from the
    start; returns ``(padded, pad_size)``. Undo with :func:`unpad_dataproto`."""
    if not isinstance(size_divisor, int) or size_divisor < 1:
        raise DataProtoError(f"pad_dataproto_to_divisor: size_divisor must be a positive int; "
                             f"found {size_divisor!r}")
    n = len(data)
    pad_size = (-n) % size_divisor
    if pad_size == 0:
        return data, 0
    if n == 0:
        raise DataProtoError("pad_dataproto_to_divisor: cannot pad an empty batch")
    index = torch.arange(n + pad_size) % n
    return data.select_idxs(index), pad_size


def unpad_dataproto(data: DataProto, pad_size: int) -> DataProto:
    """Drop the last ``pad_size`` rows (a view)."""
    if pad_size < 0 or pad_size > len(data):
        raise DataProtoError(f"unpad_dataproto: pad_size must be in [0, {len(data)}]; found {pad_size}")
    return data.slice(0, len(data) - pad_size) if pad_size else data


# ------------------------------------------------------- verl's module-level helpers


def union_two_dict(dict1: dict, dict2: dict) -> dict:
    """Add ``dict2``'s items to ``dict1`` (in place) and return it; a key both hold with
    different values is a UnionConflictError."""
    for key, value in dict2.items():
        if key in dict1 and not _same_value(dict1[key], value):
            raise UnionConflictError(f"union_two_dict: {key!r} differs: {dict1[key]!r} vs {value!r}")
        dict1[key] = value
    return dict1


def list_of_dict_to_dict_of_list(list_of_dict: list[dict]) -> dict:
    """``[{a: 1, b: 2}, {a: 3, b: 4}]`` -> ``{a: [1, 3], b: [2, 4]}`` (keys of the first)."""
    if not list_of_dict:
        return {}
    keys = list(list_of_dict[0])
    out: dict[str, list] = {k: [] for k in keys}
    for i, row in enumerate(list_of_dict):
        if set(row) != set(keys):
            raise DataProtoError(f"list_of_dict_to_dict_of_list: row {i} has keys {sorted(row)}, row 0 {sorted(keys)}")
        for k in keys:
            out[k].append(row[k])
    return out


def collate_fn(items: list[DataProtoItem]) -> DataProto:
    """DataProtoItems (rows) back into one DataProto (copy), e.g. as a DataLoader's collate."""
    if not items:
        raise DataProtoError("collate_fn: no items")
    batch = None
    if items[0].batch is not None:
        batch = torch.stack([it.batch for it in items]).contiguous()
    non_tensor = {}
    for key in items[0].non_tensor_batch:
        column = object_column([it.non_tensor_batch[key] for it in items])
        non_tensor[key] = column
    return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=dict(items[0].meta_info))


def fold_batch_dim(data: DataProto, new_batch_size: int) -> DataProto:
    """Group consecutive rows: a batch of ``B`` rows becomes ``new_batch_size`` rows whose
    columns gain a second axis of ``B // new_batch_size`` (views where possible; ``data``
    is left as it was). Undo with :func:`unfold_batch_dim`."""
    n = len(data)
    if not isinstance(new_batch_size, int) or new_batch_size < 1 or n % new_batch_size:
        raise ChunkSizeError(f"fold_batch_dim: {n} rows do not fold into {new_batch_size!r} rows")
    group = n // new_batch_size
    batch = None
    if data.batch is not None:
        batch = TensorDict({k: v.reshape(new_batch_size, group, *v.shape[1:]) for k, v in data.batch.items()},
                           batch_size=[new_batch_size])
    non_tensor = {k: v.reshape(new_batch_size, group, *v.shape[1:]) for k, v in data.non_tensor_batch.items()}
    return type(data)(batch=batch, non_tensor_batch=non_tensor, meta_info=dict(data.meta_info))


def unfold_batch_dim(data: DataProto, batch_dims: int = 2) -> DataProto:
    """Inverse of :func:`fold_batch_dim`: merge the first ``batch_dims`` axes of every
    column into one batch axis (views where possible)."""
    if batch_dims < 1:
        raise DataProtoError(f"unfold_batch_dim: batch_dims must be >= 1; found {batch_dims}")
    columns = list(data.batch.items()) if data.batch is not None else []
    first = columns[0][1] if columns else next(iter(data.non_tensor_batch.values()), None)
    if first is None:
        return type(data)(meta_info=dict(data.meta_info))
    rows = int(np.prod(tuple(first.shape[:batch_dims])))
    batch = None
    if data.batch is not None:
        batch = TensorDict({k: v.reshape(rows, *v.shape[batch_dims:]) for k, v in columns}, batch_size=[rows])
    non_tensor = {k: v.reshape(rows, *v.shape[batch_dims:]) for k, v in data.non_tensor_batch.items()}
    return type(data)(batch=batch, non_tensor_batch=non_tensor, meta_info=dict(data.meta_info))


# ---------------------------------------------------------------------- futures


@dataclass
class DataProtoFuture:
    """A DataProto that is still being computed by workers.

    Holds Ray object refs of per-rank results and a ``collect_fn`` that merges them.
    Pass it straight into the next WorkerGroup call: the dispatcher splits it with
    ``chunk`` lazily (``dispatch_fn``), so the controller never materialises it.
    """

    collect_fn: Callable[[list], DataProto]
    futures: list
    dispatch_fn: Callable[[DataProto], DataProto] | None = None

    @staticmethod
    def concat(data: list) -> "DataProtoFuture":
        """A future of the concatenation of the given object refs."""
        return DataProtoFuture(collect_fn=DataProto.concat, futures=list(data))

    def chunk(self, chunks: int) -> list["DataProtoFuture"]:
        """``chunks`` futures, the i-th resolving to ``self.get().chunk(chunks)[i]``."""
        from functools import partial

        def take(x: DataProto, i: int, n: int) -> DataProto:
            return x.chunk(n)[i]

        return [DataProtoFuture(collect_fn=self.collect_fn, futures=self.futures,
                                dispatch_fn=partial(take, i=i, n=chunks)) for i in range(chunks)]

    def get(self) -> DataProto:
        """Block until every ref is ready, then collect (and apply dispatch_fn)."""
        import ray

        output = ray.get(self.futures)
        for i, part in enumerate(output):
            if not isinstance(part, DataProto):
                raise DataProtoTypeError(
                    f"DataProtoFuture.get: part {i} resolved to {_describe(part)}, not a DataProto"
                )
        output = self.collect_fn(output)
        if self.dispatch_fn is not None:
            output = self.dispatch_fn(output)
        return output
