"""The pickle-free wire format of a DataProto: tensors as numpy views of their memory
(bf16/fp8 as raw bits, dtype beside them), object columns and meta as JSON. Ray carries it
out of band (``DataProto.__reduce__``); ``save_to_disk`` writes it to one file."""

from __future__ import annotations

import json
import warnings
from typing import Any

import numpy as np
import torch

from rlhf_core.protocol.columns import TensorDict, object_column
from rlhf_core.protocol.dtypes import RAW_BITS
from rlhf_core.protocol.errors import DataProtoError, UnsupportedObjectError

#: Version of the wire format. Bumped only on incompatible changes; never chosen at
#: run time, so every node produces and expects the same bytes.
WIRE_VERSION = 1


_JSON_SCALARS = (str, bool, int, float, type(None))


def to_json_value(value: Any, where: str) -> Any:
    """Check (and normalise numpy scalars in) one value bound for the JSON wire."""
    if isinstance(value, _JSON_SCALARS):
        return value
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return value.item()
    if isinstance(value, list):
        return [to_json_value(v, where) for v in value]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise UnsupportedObjectError(
                    f"{where}: dict keys must be str to cross the wire; found key {k!r} "
                    f"of type {type(k).__name__}"
                )
            out[k] = to_json_value(v, where)
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
        flat = [to_json_value(v, f"non_tensor_batch[{name!r}]") for v in flat]
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


def encode(batch_td: TensorDict | None, non_tensor_batch: dict, meta_info: dict, rows: int) -> dict:
    """The wire form of a batch: a dict of numpy buffers, strings and JSON bytes (no pickled
    payload). Tensors become numpy views of their memory (bf16/fp8 as raw bits,
    dtype recorded), object columns become JSON, meta_info becomes JSON.

    Raises UnsupportedObjectError naming the column (or meta key) and the offending
    type when something cannot be represented.
    """
    batch = None
    if batch_td is not None:
        batch = {k: _tensor_to_wire(v) for k, v in batch_td.items()}
    non_tensor = {k: _object_column_to_wire(k, v) for k, v in non_tensor_batch.items()}
    meta = {}
    for key, value in meta_info.items():
        if not isinstance(key, str):
            raise UnsupportedObjectError(f"meta_info keys must be str; found {key!r}")
        meta[key] = to_json_value(value, f"meta_info[{key!r}]")
    return {
        "wire_version": WIRE_VERSION,
        "batch": batch,
        "batch_size": [rows] if batch_td is not None else None,
        "non_tensor_batch": non_tensor,
        "meta_info": json.dumps(meta, allow_nan=True) if meta else "",
    }


def decode(state: dict) -> tuple[TensorDict | None, dict[str, np.ndarray], dict]:
    """(batch, non-tensor columns, meta) of a wire dict written by :func:`encode`; tensors
    and numeric columns are views of the received buffers."""
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
    return batch, non_tensor, meta


def write_file(wire: dict, filepath: str) -> None:
    """Write a wire dict to one file (overwritten if present): a numpy ``.npz`` of its raw
    buffers plus a JSON header. Nothing is pickled."""
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


def read_file(filepath: str) -> dict:
    """The wire dict of a file written by :func:`write_file` (``allow_pickle=False``)."""
    with np.load(filepath, allow_pickle=False) as npz:
        header = json.loads(npz["header"].tobytes().decode("utf-8"))
        batch = None
        if header["batch"] is not None:
            batch = {k: (dtype, np.array(npz[name])) for k, (dtype, name) in header["batch"].items()}
        non_tensor = {}
        for key, (kind, name, shape) in header["non_tensor_batch"].items():
            array = np.array(npz[name])
            non_tensor[key] = (kind, array) if kind == "raw" else (kind, array, tuple(shape))
    return ({"wire_version": header["wire_version"], "batch": batch,
                       "batch_size": header["batch_size"], "non_tensor_batch": non_tensor,
                       "meta_info": header["meta_info"]})
