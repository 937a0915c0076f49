"""verl's DataProto surface that our own code does not use, kept so that code written
against verl ports unchanged: the methods of :class:`VerlMethods` (``DataProto`` inherits
them) and verl's module-level helpers. Names and semantics follow verl's."""

from __future__ import annotations

from typing import Self, Sequence

import numpy as np
import torch

import rlhf_core.protocol.wire as wire
from rlhf_core.protocol.columns import TensorDict, _describe, _same_value
from rlhf_core.protocol.errors import (BatchSizeMismatchError, ChunkSizeError, DataProtoError, DataProtoTypeError,
                                       UnionConflictError)


class VerlMethods:
    """verl's DataProto methods beyond the contract our stages use."""

    @classmethod
    def from_single_dict(cls, data: dict[str, torch.Tensor | np.ndarray],
                         meta_info: dict | None = None, auto_padding: bool = False) -> Self:
        """Split one flat dict into tensors (-> ``batch``) and numpy arrays (-> object
        columns). Values are not copied. Any other value type is a DataProtoTypeError."""
        for key, value in data.items():
            if not isinstance(value, (torch.Tensor, np.ndarray)):
                raise DataProtoTypeError(f"from_single_dict: field {key!r} must be a torch.Tensor or "
                                         f"np.ndarray; found {_describe(value)}")
        return cls.from_dict({k: v for k, v in data.items() if isinstance(v, torch.Tensor)},
                             {k: v for k, v in data.items() if isinstance(v, np.ndarray)},
                             meta_info, auto_padding=auto_padding)


    def sample_level_repeat(self, repeat_times: Sequence[int] | torch.Tensor | np.ndarray) -> Self:
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


    def unfold_column_chunks(self, n_split: int, split_keys: Sequence[str] | None = None) -> Self:
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
        wire.write_file(self.to_wire(), filepath)

    @classmethod
    def load_from_disk(cls, filepath: str):
        """Read a file written by :meth:`save_to_disk` (``allow_pickle=False``)."""
        return cls.from_wire(wire.read_file(filepath))


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



def fold_batch_dim(data: VerlMethods, new_batch_size: int) -> VerlMethods:
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


def unfold_batch_dim(data: VerlMethods, batch_dims: int = 2) -> VerlMethods:
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

