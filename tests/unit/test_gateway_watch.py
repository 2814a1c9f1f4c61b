"""What a watch's events do to what the gateway knows of a collection, and how its byte stream splits into events."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.backends import Pool
from gateway.endpoints import Follower
from gateway.metrics import GatewayMetrics
from gateway.watch import MAX_EVENT_BYTES, Expired, Known, WatchFailed, parse_event, split_lines
from spotdrain.metrics import CollectorRegistry


def obj(name: str, version: str, **extra: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ml", "resourceVersion": version}, **extra}


def listed(*items: dict[str, Any], version: str = "10") -> dict[str, Any]:
    return {"kind": "EndpointSliceList", "metadata": {"resourceVersion": version}, "items": list(items)}


def test_events_add_change_and_delete_objects_and_move_the_version_on() -> None:
    known = Known()
    known.replace(listed(obj("a", "9")))
    assert known.apply({"type": "ADDED", "object": obj("b", "11")})
    assert known.apply({"type": "MODIFIED", "object": obj("a", "12", ready=False)})
    assert known.apply({"type": "DELETED", "object": obj("b", "13")})
    assert list(known.objects.values()) == [obj("a", "12", ready=False)]
    assert known.version == "13"


def test_a_bookmark_only_moves_the_version_on() -> None:
    known = Known()
    known.replace(listed(obj("a", "9")))
    bookmark = {"type": "BOOKMARK", "object": {"kind": "EndpointSlice", "metadata": {"resourceVersion": "40"}}}
    assert not known.apply(bookmark)
    assert (list(known.objects), known.version) == ([("ml", "a")], "40")


def test_a_deletion_of_an_unknown_object_changes_nothing_but_the_version() -> None:
    known = Known()
    known.replace(listed())
    assert not known.apply({"type": "DELETED", "object": obj("z", "11")})
    assert known.version == "11"


def test_a_410_error_event_means_list_again_and_other_errors_are_failures() -> None:
    known = Known()
    known.replace(listed())
    gone = {"kind": "Status", "status": "Failure", "reason": "Expired", "code": 410, "message": "too old"}
    with pytest.raises(Expired):
        known.apply({"type": "ERROR", "object": gone})
    with pytest.raises(WatchFailed):
        known.apply({"type": "ERROR", "object": {**gone, "code": 500, "reason": "InternalError"}})
    assert known.version == "10"  # a failed event moves nothing


@pytest.mark.parametrize(
    "event",
    [
        {"type": "ADDED"},
        {"type": "ADDED", "object": "x"},
        {"type": "SYNC", "object": obj("a", "11")},
        {"type": "MODIFIED", "object": {"metadata": {"name": "a"}}},
        {"object": obj("a", "11")},
    ],
)
def test_an_event_that_is_not_one_is_a_failure_and_changes_nothing(event: dict[str, Any]) -> None:
    known = Known()
    known.replace(listed(obj("a", "9")))
    with pytest.raises(WatchFailed):
        known.apply(event)
    assert (list(known.objects.values()), known.version) == ([obj("a", "9")], "10")


@pytest.mark.parametrize("answer", [[], {"items": []}, {"metadata": {"resourceVersion": "1"}}, "<html>"])
def test_a_list_answer_without_items_or_a_version_is_a_failure(answer: Any) -> None:
    with pytest.raises(WatchFailed):
        Known().replace(answer)


@given(st.lists(st.dictionaries(st.text(max_size=5), st.integers(), max_size=3), max_size=5), st.data())
def test_events_split_anywhere_come_out_whole_and_in_order(events: list[dict[str, int]], data: st.DataObject) -> None:
    stream = b"".join(json.dumps(e).encode() + b"\n" for e in events)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=6)))
    buffer = bytearray()
    lines: list[bytes] = []
    for start, end in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        lines += split_lines(buffer, stream[start:end])
    assert [parse_event(line) for line in lines] == events
    assert buffer == b""


def test_a_line_without_end_past_the_limit_is_refused_rather_than_held() -> None:
    buffer = bytearray()
    split_lines(buffer, b"x" * MAX_EVENT_BYTES)
    with pytest.raises(WatchFailed):
        split_lines(buffer, b"y")


@given(st.binary(max_size=200))
def test_any_bytes_parse_to_an_object_or_fail_as_a_watch_failure(line: bytes) -> None:
    with contextlib.suppress(WatchFailed):
        assert isinstance(parse_event(line), dict)


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=4),
        lambda c: st.lists(c) | st.dictionaries(st.text(max_size=4), c),
        max_leaves=10,
    )
)
def test_any_json_as_an_event_is_taken_or_refused_never_a_crash(value: Any) -> None:
    known = Known()
    known.replace(listed())
    with contextlib.suppress(Expired, WatchFailed):
        known.apply(value if isinstance(value, dict) else {"type": "ADDED", "object": value})


class Started:
    """Node watches the follower asked for, as tasks that wait until cancelled."""

    def __init__(self) -> None:
        self.tasks: dict[str, asyncio.Task[None]] = {}

    def __call__(self, name: str, on_change: Any) -> asyncio.Task[None]:
        self.tasks[name] = asyncio.create_task(asyncio.sleep(3600))
        return self.tasks[name]


def endpoint_slice(*endpoints: tuple[str, bool, str]) -> dict[str, Any]:
    return {
        "metadata": {"name": "s", "namespace": "ml", "resourceVersion": "1"},
        "ports": [{"name": "http", "port": 8000}],
        "endpoints": [
            {"addresses": [ip], "conditions": {"ready": ready}, "nodeName": node} for ip, ready, node in endpoints
        ],
    }


async def test_the_follower_watches_each_endpoints_node_and_only_while_an_endpoint_sits_there() -> None:
    pool = Pool(["http://seed:1"], GatewayMetrics.create(CollectorRegistry()))
    started = Started()
    follower = Follower(pool, port="http", watch_node=started)
    follower.slices([endpoint_slice(("10.0.0.1", True, "gpu-1"), ("10.0.0.2", False, "gpu-2"))])
    assert [b.url for b in pool.backends] == ["http://10.0.0.1:8000"]
    assert sorted(started.tasks) == ["gpu-1", "gpu-2"]  # a draining pod's node too: it still holds streams
    node = {"metadata": {"name": "gpu-2", "annotations": {"spotdrain.io/termination-time": "2026-12-01T10:00:00Z"}}}
    follower.node("gpu-2", [node])
    assert list(pool.leaving) == ["http://10.0.0.2:8000"]
    assert pool.leaving_changed.is_set()
    follower.slices([endpoint_slice(("10.0.0.1", True, "gpu-1"))])
    await asyncio.sleep(0)
    assert started.tasks["gpu-2"].cancelled()
    assert list(follower.watching) == ["gpu-1"]
    assert pool.leaving == {}
    follower.watching["gpu-1"].cancel()
