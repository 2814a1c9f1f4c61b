"""Ports for the programs a test starts: free, and never the same one twice in a row."""

from __future__ import annotations

import socket

import pytest

from simulate.fakes import processes


def test_a_port_the_kernel_gives_again_is_not_given_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    given = iter([40001, 40001, 40001, 40002])

    class Probe:
        def __enter__(self) -> Probe:
            return self

        def __exit__(self, *_: object) -> None:
            pass

        def bind(self, address: tuple[str, int]) -> None:
            self.port = next(given)

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(processes, "_GIVEN", type(processes._GIVEN)(maxlen=256))
    monkeypatch.setattr(socket, "socket", Probe)
    assert [processes.free_port(), processes.free_port()] == [40001, 40002]


def test_the_ports_are_free_to_bind() -> None:
    ports = [processes.free_port() for _ in range(20)]
    assert len(set(ports)) == 20
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
