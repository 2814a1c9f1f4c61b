from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.record import RECORD_MAX_BYTES, DrainRecord, RecordError, parse_record, read_record, write_record
from tests.unit.test_notices import JSON

RECORD = DrainRecord("notice:spot-interruption", datetime(2026, 12, 1, 8, 0, tzinfo=UTC), None)


def test_a_record_reads_back_as_it_was_written(tmp_path: Path) -> None:
    deadline = datetime(2026, 12, 1, 8, 2, tzinfo=UTC)
    for record in (RECORD, DrainRecord("sigterm", RECORD.started, deadline)):
        write_record(tmp_path / "draining", record)
        assert read_record(tmp_path / "draining") == record
    assert [p.name for p in tmp_path.iterdir()] == ["draining"], "no partial file left behind"


def test_no_record_is_none_not_an_error(tmp_path: Path) -> None:
    assert read_record(tmp_path / "draining") is None


@pytest.mark.parametrize("kind", ["directory", "fifo", "huge", "dangling symlink"])
def test_what_is_not_a_small_regular_file_is_a_record_error_and_never_blocks(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "draining"
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "huge":
        path.write_bytes(b" " * (RECORD_MAX_BYTES + 1))
    else:
        path.symlink_to(tmp_path / "absent")
    with pytest.raises(RecordError):
        read_record(path)


@pytest.mark.parametrize(
    "raw",
    [b"", b"\xff\xfe", b"[" * 100_000, b'{"reason": "x", "started": "0001-01-01T00:00:00+01:00"}', b'{"reason": 1}'],
)
def test_unusable_content_is_a_record_error(raw: bytes) -> None:
    with pytest.raises(RecordError):
        parse_record(raw)


@given(st.binary(max_size=200) | (JSON | st.fixed_dictionaries({"reason": JSON, "started": JSON})).map(json.dumps))
def test_no_content_makes_the_reader_raise_anything_but_record_error(raw: bytes | str) -> None:
    try:
        record = parse_record(raw.encode() if isinstance(raw, str) else raw)
    except RecordError:
        return
    assert record.started.tzinfo is not None
