"""Tensor dtypes numpy cannot hold, and the integer type whose bits carry them.

The wire format (``protocol/dataproto.py``) and snapshots (``snapshot/``) both move bf16 and fp8
tensors as their raw bit patterns with the logical dtype recorded beside them; this is
the one table they share.
"""

from __future__ import annotations

import numpy as np
import torch

#: logical dtype -> (torch integer dtype of the same width, numpy dtype the bits are stored as)
RAW_BITS: dict[torch.dtype, tuple[torch.dtype, type]] = {
    torch.bfloat16: (torch.int16, np.uint16),
    torch.float8_e4m3fn: (torch.uint8, np.uint8),
    torch.float8_e5m2: (torch.uint8, np.uint8),
}
#: the same table by dtype name (as recorded next to the bits)
RAW_BITS_BY_NAME: dict[str, tuple[torch.dtype, type]] = {
    str(k).removeprefix("torch."): v for k, v in RAW_BITS.items()}


def to_bits(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor of a raw-bits dtype as a numpy view of its bits (no copy)."""
    view, stored = RAW_BITS[t.dtype]
    return t.view(view).numpy().view(stored)


def from_bits(dtype_name: str, data: np.ndarray) -> torch.Tensor:
    """The inverse of ``to_bits`` (a view when ``data`` is contiguous)."""
    view, _ = RAW_BITS_BY_NAME[dtype_name]
    as_torch_int = data.view(np.int16) if view == torch.int16 else data
    return torch.from_numpy(np.ascontiguousarray(as_torch_int)).view(getattr(torch, dtype_name))
