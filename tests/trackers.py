"""Reading back what a job's trackers wrote, with each tracker's own reader: TensorBoard's
event accumulator, and W&B's record schema (its protobuf `Record`) over the transaction log
of an offline run (LevelDB's log framing: 32 KiB blocks of checksummed chunks, after W&B's
7-byte header), which W&B's Python package no longer reads itself."""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768
CHUNK_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Tag -> [(step, value)] of every scalar in the folder's event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def tensorboard_texts(folder: Path, tag: str) -> list[tuple[int, str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in events.Tensors(f"{tag}/text_summary")]


def wandb_records(path: Path):
    """Every record of an offline run's `.wandb` file, as W&B's protobuf `Record`s."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    position, chunks = CHUNK_HEADER, []
    while position + CHUNK_HEADER <= len(data):
        left = BLOCK - position % BLOCK
        _, length, kind = struct.unpack("<IHB", data[position : position + CHUNK_HEADER])
        if left < CHUNK_HEADER or (length == 0 and kind == 0):  # a block's zero-filled tail
            position += left
            continue
        body = data[position + CHUNK_HEADER : position + CHUNK_HEADER + length]
        position += CHUNK_HEADER + length
        chunks = [body] if kind in (FULL, FIRST) else [*chunks, body]
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            yield record


def wandb_run(run_dir: Path) -> tuple[dict, list[dict]]:
    """An offline run's config and history rows (key -> value) under `run_dir/wandb`."""
    (path,) = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))[-1:]
    config, rows = {}, []
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            config |= {item.key: json.loads(item.value_json) for item in record.run.config.update}
        elif kind == "history":
            rows.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    return config, rows
