"""extproc killed under load and restarted: fail-open keeps serving through the fallback route, fail-closed
answers 503 with a JSON body; at most 0.1 % of requests fail across the switch and back."""

from __future__ import annotations

import signal
import time

import orjson
import pytest

from tests.faults.harness import FaultStack, LoadRun, report, wait_until

pytestmark = pytest.mark.e2e

DOWN_S = 2.0
MAX_ERROR_SHARE = 0.001


def closed_answer_ok(status: int, body: bytes) -> bool:
    """Fail-closed: served, or a 503 whose body is a JSON object (Envoy's local reply as OpenAI error)."""
    if status == 200:
        return True
    try:
        return status == 503 and isinstance(orjson.loads(body), dict)
    except orjson.JSONDecodeError:
        return False


def test_extproc_killed_and_restarted_under_load(fault_stack: FaultStack) -> None:
    stack = fault_stack
    closed_503: list[bytes] = []

    def closed_outcome(status: int, body: bytes) -> bool:
        if status == 503:
            closed_503.append(body)
        return closed_answer_ok(status, body)

    with LoadRun(stack, stack.envoy_port, 50) as load, \
            LoadRun(stack, stack.closed_port, 10, accept=closed_outcome) as closed_load:
        time.sleep(0.5)
        killed_at = time.monotonic()
        stack.extproc.kill(signal.SIGKILL)
        stack.extproc_closed.kill(signal.SIGKILL)
        time.sleep(DOWN_S)
        restarted_at = time.monotonic()
        stack.extproc.start()
        stack.extproc_closed.start()
        wait_until(lambda: stack.metric("poolgate_extproc_workers") == 3
                   and stack.metric("poolgate_extproc_workers", stack.closed_metrics_port) == 3, 20,
                   "extprocs serving a fleet again")
        # Routing through extproc again: the fail-closed Envoy serves 200s only when extproc answers.
        wait_until(lambda: stack.serving(stack.closed_port), 20, "fail-closed Envoy served through extproc")
        recovery = time.monotonic() - restarted_at
        time.sleep(1.0)
    result = load.result
    routed_after = stack.metric("poolgate_extproc_requests_total")
    report("extproc", result, recovery,
           f"down {restarted_at - killed_at:.1f} s, fail-open error share "
           f"{len(result.failed) / max(result.sent, 1):.4%}; fail-closed: sent {closed_load.result.sent}, "
           f"503 JSON {len(closed_503)}, other failures {len(closed_load.result.failed)}")
    assert len(result.failed) <= MAX_ERROR_SHARE * result.sent, \
        f"fail-open errors: {[(s.status, s.error[:80]) for s in result.failed[:5]]}"
    assert closed_503, "the fail-closed Envoy never answered 503 while extproc was down"
    assert not closed_load.result.failed, [(s.status, s.error[:80]) for s in closed_load.result.failed[:5]]
    assert routed_after is not None and routed_after > 0, "the restarted extproc routed nothing"
