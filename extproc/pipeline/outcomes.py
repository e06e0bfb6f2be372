"""What a stage of the request pipeline answers: plain values, never protobuf.

The director passes them on to the servicer, which is the only place they become Envoy messages
(``answers``). A request ends in exactly one of ``Passthrough``, ``ModelList``, ``Placed`` or ``Refused``;
``Proceed``, ``Admitting`` and ``Wait`` say the answer comes later.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from extproc.catalogue import ModelCard
from extproc.errors import ApiError
from extproc.scheduling import Decision


@dataclass(frozen=True, slots=True)
class Proceed:
    """The headers pass and the body follows; what of the response must come back to extproc."""

    watch_response_body: bool = False
    watch_response_headers: bool = False


@dataclass(frozen=True, slots=True)
class Passthrough:
    """Not routed by poolgate: on to the default route, without the client's routing headers."""

    remove: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ModelList:
    """``GET /v1/models``, answered by extproc itself."""

    cards: tuple[ModelCard, ...]
    created: int


@dataclass(frozen=True, slots=True)
class Refused:
    """The request ends in ``error``; ``reason`` (when set) counts it as a refusal of the tenant's request."""

    error: ApiError
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class Placed:
    """Send the request to the decision's worker, with these header changes and (when rewritten) this body."""

    decision: Decision
    remove: tuple[str, ...] = ()
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes | None = None


@dataclass(frozen=True, slots=True)
class Wait:
    """Held in the priority queue: the final answer (placed or refused) comes within ``timeout_s``."""

    timeout_s: float


@dataclass(frozen=True, slots=True)
class Admitting:
    """The tenant's quota is being asked (one Redis call); the director's ``admit`` gives the answer."""


@dataclass(frozen=True, slots=True)
class RewriteBody:
    """The response body must be rewritten (its model name restored); ask for it unless it already comes."""

    body_watched: bool


ADMITTING = Admitting()

Final: TypeAlias = Placed | Refused
"""How a routed request ends."""
Routing: TypeAlias = Placed | Refused | Wait
"""What placing an admitted request answers now."""
