"""Columns of a batch: the tensordict import, object columns, row operations on tensors,
and the equality rules ``union`` and ``concat`` apply."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from rlhf_core.protocol.dtypes import RAW_BITS
from rlhf_core.protocol.errors import BatchSizeMismatchError, DataProtoTypeError, UnionConflictError


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
