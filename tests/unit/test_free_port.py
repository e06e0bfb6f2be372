"""Tests pick several ports in a row for one stack (Envoy's listeners, its admin, extproc): the OS may hand
the same free port to two binds in a row, and Envoy then refuses to start on a duplicate listener address."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from poolgate.kernel import net


class _SameEphemeralPort(socket.socket):
    """A socket whose ``bind(0)`` gets 50000, then 50000 again, then 50001: what a kernel may do."""

    given: Iterator[int] = iter(())

    def bind(self, address: object) -> None:
        self._port = next(self.given)

    def getsockname(self) -> tuple[str, int]:
        return ("127.0.0.1", self._port)


def test_free_port_never_hands_out_the_same_port_twice_in_a_row(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_SameEphemeralPort, "given", iter([50000, 50000, 50001]))
    monkeypatch.setattr(net.socket, "socket", _SameEphemeralPort)
    monkeypatch.setattr(net, "_handed_out", type(net._handed_out)(maxlen=16))
    assert [net.free_port(), net.free_port()] == [50000, 50001]


def test_ports_picked_for_one_stack_are_distinct_and_bindable() -> None:
    ports = [net.free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[-1]))
