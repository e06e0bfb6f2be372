"""The Gateway API Inference Extension endpoint-picker protocol, as far as it differs from poolgate's own.

A gateway may restrict the pick to a subset of endpoints: it sends them in the request's filter metadata,
namespace ``envoy.lb.subset_hint``, key ``x-gateway-destination-endpoint-subset``, a list of ``ip:port``.
extproc then picks only among fleet workers at those addresses; an empty or unmatched subset means no
endpoint (503). The answer carries the pick in ``envoy.lb`` metadata (always) and, in ``gie`` mode, also in
the ``x-gateway-destination-endpoint`` request header (see ``answers.routed_body``).
"""

from __future__ import annotations

from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest

from extproc.snapshot import FleetSnapshot, build_snapshot

SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
GIE_MODE = "gie"


def endpoint_subset(message: ProcessingRequest) -> frozenset[str] | None:
    """The ``ip:port`` endpoints the gateway allows for this request; None when it sent no subset.

    Entries that are not strings are ignored: a malformed hint must not widen the choice, and an empty
    result still restricts (to nothing)."""
    namespace = message.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or SUBSET_KEY not in namespace.fields:
        return None
    value = namespace.fields[SUBSET_KEY]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return frozenset(v.string_value for v in value.list_value.values if v.WhichOneof("kind") == "string_value")
    if kind == "string_value":  # tolerate a comma list, as the pin itself is written
        return frozenset(part.strip() for part in value.string_value.split(",") if part.strip())
    return frozenset()


def within(snapshot: FleetSnapshot, subset: frozenset[str]) -> FleetSnapshot:
    """The snapshot with only the workers whose address is in ``subset`` (same pools, time and freshness), so
    every filter, scorer and fallback of the scheduler sees the restricted fleet."""
    kept = tuple(w for w in snapshot.workers if w.address in subset)
    if len(kept) == len(snapshot.by_id):
        return snapshot
    return build_snapshot(kept, snapshot.pools.values(), snapshot.taken_at, snapshot.stale_after_s,
                          vouched=snapshot.vouched)
