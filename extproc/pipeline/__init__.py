"""The request pipeline: a director over stages, each a module with its own small dependencies.

identify (``identify``) → resolve (``resolve``: catalogue, parameters, profile) → admit (``admit``: quota) →
hold (``hold``: priority queue) → place (``place``: scheduler, reservations) → respond (``respond``: usage,
model name, GenAI observers). Stages return outcomes (``outcomes``), never protobuf; the servicer
(``extproc.service``) is the only reader of Envoy's messages and writer of its answers.
"""

from extproc.pipeline.admit import Admit
from extproc.pipeline.context import Arrival, Placement, RequestContext, Resolved
from extproc.pipeline.director import Director
from extproc.pipeline.hold import CapacitySignal, Hold
from extproc.pipeline.identify import Identify
from extproc.pipeline.outcomes import (
    Admitting,
    ModelList,
    Passthrough,
    Placed,
    Proceed,
    Refused,
    RewriteBody,
    Wait,
)
from extproc.pipeline.place import DECISION_HEADER, TENANT_HEADER, Place, SnapshotSource
from extproc.pipeline.resolve import Resolve
from extproc.pipeline.respond import Respond, ResponseFeed

__all__ = ["DECISION_HEADER", "TENANT_HEADER", "Admit", "Admitting", "Arrival", "CapacitySignal", "Director", "Hold",
           "Identify", "ModelList", "Passthrough", "Place", "Placed", "Placement", "Proceed", "Refused",
           "RequestContext", "Resolve", "Resolved", "Respond", "ResponseFeed", "RewriteBody", "SnapshotSource",
           "Wait"]
