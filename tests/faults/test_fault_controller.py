"""The controller killed under load and restarted: Envoy keeps its endpoints (no membership change), no
request fails, and the restarted controller rebuilds from Redis and serves the very same resource versions."""

from __future__ import annotations

import signal
import time

import pytest

from tests.faults.harness import FaultStack, LoadRun, report, wait_until

pytestmark = pytest.mark.e2e

DOWN_S = 2.0


def test_controller_killed_and_restarted_under_load(fault_stack: FaultStack) -> None:
    stack = fault_stack
    wait_until(lambda: len(stack.envoy_endpoints()) == 3, 15, "three endpoints in Envoy")
    hosts_before = stack.envoy_endpoints()
    versions_before = stack.xds_versions()
    membership_before = stack.envoy_stat("cluster.pool-chat.membership_change")
    with LoadRun(stack, stack.envoy_port, 40) as load:
        time.sleep(0.5)
        killed_at = time.monotonic()
        stack.controller.kill(signal.SIGKILL)
        wait_until(lambda: stack.envoy_stat("control_plane.connected_state") == "0", 5, "Envoy sees xDS gone")
        time.sleep(DOWN_S)
        hosts_during = stack.envoy_endpoints()
        restarted_at = time.monotonic()
        stack.restart(stack.controller, stack.xds_port)
        wait_until(lambda: stack.envoy_stat("control_plane.connected_state") == "1", 20, "Envoy reconnected")
        recovery = time.monotonic() - restarted_at
        time.sleep(1.0)  # the restarted controller's first pushes have arrived
    result = load.result
    hosts_after = stack.envoy_endpoints()
    versions_after = stack.xds_versions()
    flaps = int(stack.envoy_stat("cluster.pool-chat.membership_change") or 0) - int(membership_before or 0)
    report("controller", result, recovery,
           f"down {restarted_at - killed_at:.1f} s, endpoint membership changes {flaps}, versions before "
           f"{versions_before} after {versions_after}")
    assert hosts_during == hosts_before, "Envoy changed its endpoints while the controller was away"
    assert hosts_after == hosts_before
    assert flaps == 0
    assert versions_after == versions_before, "the restarted controller serves different resources"
    assert not result.failed, [(s.status, s.error[:80]) for s in result.failed[:5]]
