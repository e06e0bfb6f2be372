"""``poolgate up`` never gives two of its servers one port, even when the OS hands the same free port out
twice (Envoy and gRPC listen with SO_REUSEPORT, so both would bind it without an error)."""

from __future__ import annotations

import pytest

from poolgate import up


def test_a_port_handed_out_twice_or_already_taken_is_not_chosen_again(monkeypatch: pytest.MonkeyPatch) -> None:
    handed_out = iter([8080, 5000, 5000, 5001, 8080, 5002])
    monkeypatch.setattr(up, "free_port", lambda: next(handed_out))
    pick = up.port_picker([8080, None, 0])
    assert [pick(), pick(), pick()] == [5000, 5001, 5002]
