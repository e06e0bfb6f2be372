"""Fault settings: validated on every change, named in the error."""

from __future__ import annotations

import pytest

from simworker.faults import FaultSettings


def test_update_changes_only_named_fields() -> None:
    settings = FaultSettings().updated({"error_rate": 0.5, "crash_after_requests": 3, "hang": True})
    assert (settings.error_rate, settings.crash_after_requests, settings.hang) == (0.5, 3, True)
    assert settings.updated({"crash_after_requests": None}).crash_after_requests is None


@pytest.mark.parametrize(("changes", "field"), [
    ({"error_rate": 1.5}, "error_rate"), ({"error_rate": "x"}, "error_rate"), ({"hang": 1}, "hang"),
    ({"slow_start_s": -1}, "slow_start_s"), ({"crash_after_requests": 1.5}, "crash_after_requests"),
    ({"bogus": 1}, "bogus"), ({"added_latency_s": None}, "added_latency_s"),
])
def test_bad_updates_name_the_field(changes: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        FaultSettings().updated(changes)
