"""The drain in progress, recorded in the drain directory: a sidecar restarted mid-drain resumes it from there.

The directory is the ``emptyDir`` the sidecar shares with the engine, so it outlives a restart of the sidecar's
container (not of the pod). Its content is an input like any other: whatever it holds, reading it raises only
RecordError, and a record that exists but cannot be read still means a drain is in progress.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from spotdrain.clock import parse_rfc3339, rfc3339

RECORD_MAX_BYTES = 4096


class RecordError(ValueError):
    """The record exists but says nothing usable."""


@dataclass(frozen=True)
class DrainRecord:
    reason: str
    started: datetime  # when the first sidecar started this drain: the drain timeout counts from here
    deadline: datetime | None  # a notice's deadline, if one drove the drain


def render_record(record: DrainRecord) -> str:
    deadline = None if record.deadline is None else rfc3339(record.deadline)
    return json.dumps({"reason": record.reason, "started": rfc3339(record.started), "deadline": deadline})


def _moment(value: object, field: str) -> datetime:
    if not isinstance(value, str):
        raise RecordError(f"drain record: {field} is not a time")
    try:
        return parse_rfc3339(value)
    except (ValueError, OverflowError):
        raise RecordError(f"drain record: {field} {value[:40]!r} is not a time") from None


def parse_record(raw: bytes) -> DrainRecord:
    """The record's content as a DrainRecord; raises RecordError, and nothing else, for any other bytes."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as error:
        raise RecordError(f"drain record is not JSON: {type(error).__name__}") from None
    if not isinstance(data, dict) or not isinstance(data.get("reason"), str):
        raise RecordError("drain record is not an object with a reason")
    deadline = data.get("deadline")
    return DrainRecord(
        reason=data["reason"],
        started=_moment(data.get("started"), "started"),
        deadline=None if deadline is None else _moment(deadline, "deadline"),
    )


def write_record(path: Path, record: DrainRecord) -> None:
    """Replace the record atomically: a restart in the middle finds the old one or the new one, never half."""
    partial = path.with_name(f".{path.name}.partial")
    # Four system calls, no file object: every sidecar on a node writes its record in the same instant.
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        os.write(descriptor, render_record(record).encode())
    finally:
        os.close(descriptor)
    os.replace(partial, path)


def read_record(path: Path) -> DrainRecord | None:
    """The recorded drain, None when there is none; RecordError when something is there but unusable."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return None
    except OSError as error:
        raise RecordError(f"drain record: {type(error).__name__}: {error}") from None
    if not stat.S_ISREG(mode):  # a FIFO would block the read, a directory cannot be read
        raise RecordError("drain record is not a regular file")
    try:
        with path.open("rb") as file:
            raw = file.read(RECORD_MAX_BYTES + 1)
    except OSError as error:
        raise RecordError(f"drain record: {type(error).__name__}: {error}") from None
    if len(raw) > RECORD_MAX_BYTES:
        raise RecordError(f"drain record is larger than {RECORD_MAX_BYTES} bytes")
    return parse_record(raw)
