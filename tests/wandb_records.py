"""Reads a W&B offline run file (``run-<id>.wandb``): a 7-byte header (``:W&B``, a magic,
a version), then LevelDB-log records in 32 KiB blocks (crc32, 2-byte length, type: 1 full,
2 first, 3 middle, 4 last), each a ``wandb_internal_pb2.Record``. For tests: what a run
wrote, without W&B's service."""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024
HEADER = 7
RECORD_HEADER = 7


def records(path: Path):
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", data[:8]
    offset, pending = HEADER, b""
    while offset + RECORD_HEADER <= len(data):
        left = BLOCK - offset % BLOCK
        if left < RECORD_HEADER:  # the block's tail is padding
            offset += left
            continue
        _, length, kind = struct.unpack("<IHB", data[offset:offset + RECORD_HEADER])
        body = data[offset + RECORD_HEADER:offset + RECORD_HEADER + length]
        offset += RECORD_HEADER + length
        if kind == 0 and length == 0:
            continue
        pending = body if kind in (1, 2) else pending + body
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def history(path: Path) -> list[dict]:
    """Each logged step's values, by metric name."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows
