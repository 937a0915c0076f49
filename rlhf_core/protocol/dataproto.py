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
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

import rlhf_core.protocol.wire as wire
from rlhf_core.protocol.columns import (NonTensorData, NonTensorStack, TensorDict, _cat_rows, _check_index_tensor,
                                        _describe, _merge_meta, _merge_metrics, _repeat_rows, _same_value,
                                        _take_rows, object_column, union_numpy_dict, union_tensor_dict)
from rlhf_core.protocol.errors import (BatchSizeMismatchError, ChunkSizeError, DataProtoError, DataProtoTypeError,
                                       MissingKeyError, UnionConflictError)
from rlhf_core.protocol.verl_compat import VerlMethods

#: meta_info key that, when true, lets ``chunk`` split a batch that does not divide
#: evenly. Same key as verl so ported code that sets it keeps working.
AUTO_PADDING_KEY = "_verl_auto_padding"


class DataProtoConfig:
    """Process-wide DataProto settings (verl's name). ``auto_padding``: every batch may
    be chunked unevenly, as if each had ``meta_info[AUTO_PADDING_KEY] = True``."""

    auto_padding: bool = False


# ------------------------------------------------------------------------ DataProto


@dataclass
class DataProtoItem:
    """One row of a DataProto: ``batch`` is a 0-dim TensorDict view, ``non_tensor_batch``
    holds that row's object values, ``meta_info`` is the parent's dict (shared)."""

    batch: TensorDict | None = None
    non_tensor_batch: dict = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)



@dataclass
class DataProto(VerlMethods):
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

    # ---------------------------------------------------------------- pickle-free wire

    def to_wire(self) -> dict:
        """The wire form: a dict of numpy buffers, strings and JSON bytes (no pickled
        payload). Tensors become numpy views of their memory (bf16/fp8 as raw bits,
        dtype recorded), object columns become JSON, meta_info becomes JSON.

        Raises UnsupportedObjectError naming the column (or meta key) and the offending
        type when something cannot be represented.
        """
        return wire.encode(self.batch, self.non_tensor_batch, self.meta_info, len(self))

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


def _from_wire(state: dict) -> DataProto:
    batch, non_tensor, meta = wire.decode(state)
    return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)


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

