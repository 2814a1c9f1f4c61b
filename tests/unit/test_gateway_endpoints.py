from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from gateway.endpoints import ready_urls


def slice_(endpoints: list[dict[str, Any]], *, ports: list[dict[str, Any]], family: str = "IPv4") -> dict[str, Any]:
    return {"addressType": family, "endpoints": endpoints, "ports": ports}


def test_ready_endpoints_become_backends_and_the_rest_do_not() -> None:
    slices = [
        slice_(
            [
                {"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
                {"addresses": ["10.0.0.2"], "conditions": {"ready": False, "terminating": True}},
                {"addresses": ["10.0.0.3"], "conditions": {}},  # nil ready means ready
                {"addresses": ["10.0.0.4"], "conditions": {"terminating": True}},  # going away: never ready
                {"addresses": []},
            ],
            ports=[{"name": "metrics", "port": 9090}, {"name": "http", "port": 8000}],
        ),
        slice_([{"addresses": ["fd00::1"]}], ports=[{"name": "http", "port": 8000}], family="IPv6"),
    ]
    assert ready_urls(slices, port="http") == ["http://10.0.0.1:8000", "http://10.0.0.3:8000", "http://[fd00::1]:8000"]
    assert ready_urls(slices, port="8000") == ready_urls(slices, port="http")
    assert ready_urls(slices, port=None)[0] == "http://10.0.0.1:9090"  # the first port by default
    assert ready_urls(slices, port="grpc") == []


json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=9), inner, max_size=4),
    max_leaves=20,
)


@given(st.lists(json, max_size=4), st.none() | st.text(max_size=4))
def test_any_json_gives_a_list_of_urls_never_an_exception(slices: list[Any], port: str | None) -> None:
    assert all(url.startswith("http://") for url in ready_urls(slices, port=port))
