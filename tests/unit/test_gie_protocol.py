"""The endpoint-picker protocol's pieces: reading the subset hint, restricting the fleet, the header pin."""

from __future__ import annotations

import pytest
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest

from extproc import answers
from extproc.endpoint_picker import SUBSET_KEY, SUBSET_NAMESPACE, endpoint_subset, within
from extproc.scheduling import Decision
from extproc.snapshot import build_snapshot
from poolgate.kernel.config import PoolSpec
from poolgate.kernel.fleet import WorkerRecord
from poolgate.kernel.routing import DESTINATION_ENDPOINT_KEY, LB_METADATA_NAMESPACE


def _message(value: object | None) -> ProcessingRequest:
    message = ProcessingRequest()
    if value is not None:
        namespace = message.metadata_context.filter_metadata[SUBSET_NAMESPACE]
        namespace.update({SUBSET_KEY: value})
    return message


@pytest.mark.parametrize(("value", "subset"), [
    (None, None),
    (["10.0.0.1:8000", "10.0.0.2:8000"], frozenset({"10.0.0.1:8000", "10.0.0.2:8000"})),
    ([], frozenset()),
    ("10.0.0.1:8000, 10.0.0.3:8000", frozenset({"10.0.0.1:8000", "10.0.0.3:8000"})),
    (7, frozenset()),
])
def test_subset_hint(value: object | None, subset: frozenset[str] | None) -> None:
    assert endpoint_subset(_message(value)) == subset


def test_within_keeps_only_the_subset() -> None:
    pool = PoolSpec(name="chat", model="m")
    workers = [WorkerRecord(id=f"w{i}", pool="chat", model="m", host="10.0.0.1", port=8000 + i, updated_at=100.0)
               for i in range(3)]
    snapshot = build_snapshot(workers, [pool], taken_at=100.0, stale_after_s=3.0)
    restricted = within(snapshot, frozenset({"10.0.0.1:8001"}))
    assert [w.id for w in restricted.ready_workers_for("m")] == ["w1"]
    assert within(snapshot, frozenset(w.address for w in workers)) is snapshot
    assert within(snapshot, frozenset()).workers_for("m") == ()


@pytest.mark.parametrize("header_pin", [False, True])
def test_the_header_pin_only_in_gie_mode(header_pin: bool) -> None:
    decision = Decision("w1", "chat", "pool-chat", "10.0.0.1:8001", fallbacks=("10.0.0.1:8002",))
    answer = answers.routed_body(decision, remove=[DESTINATION_ENDPOINT_KEY], header_pin=header_pin)
    mutation = answer.request_body.response.header_mutation
    headers = {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}
    pin = answer.dynamic_metadata.fields[LB_METADATA_NAMESPACE].struct_value.fields[DESTINATION_ENDPOINT_KEY]
    assert pin.string_value == "10.0.0.1:8001,10.0.0.1:8002"
    if header_pin:
        assert headers[DESTINATION_ENDPOINT_KEY] == "10.0.0.1:8001"
        assert DESTINATION_ENDPOINT_KEY not in mutation.remove_headers
    else:
        assert DESTINATION_ENDPOINT_KEY not in headers
        assert DESTINATION_ENDPOINT_KEY in mutation.remove_headers
