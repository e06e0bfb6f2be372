"""When a drain is over: nothing in flight after the settle time, the worker gone, or the grace period."""

from __future__ import annotations

import pytest

from controller.drain import DrainView, drain_finished
from poolgate.kernel.config import DrainSettings

SETTINGS = DrainSettings(grace_s=30.0, settle_s=1.0)


@pytest.mark.parametrize(("view", "over"), [
    (DrainView(0.2, True, 0, 0, 0), None),  # extproc replicas may not have seen Draining yet
    (DrainView(1.5, True, 0, 0, 0), "nothing in flight"),
    (DrainView(5.0, True, 1, 0, 0), None),  # extproc still counts a request
    (DrainView(5.0, True, 0, 2, 0), None),  # the engine still runs two (e.g. streams)
    (DrainView(5.0, True, 0, 0, 1), None),
    (DrainView(0.1, False, 3, 0, 0), "left the registry"),
    (DrainView(30.0, True, 4, 4, 0), "grace period of 30 s ended with 4 in flight"),
])
def test_drain_finished(view: DrainView, over: str | None) -> None:
    reason = drain_finished(view, SETTINGS)
    if over is None:
        assert reason is None
    else:
        assert reason is not None and over in reason
