"""Builds the ext_proc messages extproc sends back to Envoy. The one place errors become responses.

Header values go in ``raw_value``: Envoy ignores ``value`` in mutations and would send an empty header.
"""

from __future__ import annotations

from collections.abc import Iterable

import orjson
from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    BodyMutation,
    BodyResponse,
    CommonResponse,
    HeaderMutation,
    HeadersResponse,
    ImmediateResponse,
    ProcessingResponse,
    TrailersResponse,
)
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.duration_pb2 import Duration
from google.protobuf.struct_pb2 import Struct

from extproc.catalogue import ModelCard
from extproc.errors import ApiError
from extproc.scheduling import Decision
from poolgate.kernel.routing import CLUSTER_HEADER, DESTINATION_ENDPOINT_KEY, LB_METADATA_NAMESPACE

_OVERWRITE = HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
NEVER_UPSTREAM = ("authorization",)
"""Client headers removed from every request that goes on to a worker: the tenant's API key is extproc's to
check, and a worker (or whoever reads its request log) must never see it."""


def _header(key: str, value: str) -> HeaderValueOption:
    return HeaderValueOption(header=HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE)


def _mutation(remove: Iterable[str], set_headers: Iterable[HeaderValueOption] = ()) -> HeaderMutation | None:
    remove = list(remove)
    set_list = list(set_headers)
    if not remove and not set_list:
        return None
    return HeaderMutation(set_headers=set_list, remove_headers=remove)


def _upstream_removals(remove: Iterable[str]) -> list[str]:
    """``remove`` plus ``NEVER_UPSTREAM``, each once."""
    return [*NEVER_UPSTREAM, *(h for h in remove if h not in NEVER_UPSTREAM)]


WATCH_RESPONSE_BODY = ProcessingMode(
    request_header_mode=ProcessingMode.SEND, response_header_mode=ProcessingMode.SKIP,
    request_body_mode=ProcessingMode.BUFFERED, response_body_mode=ProcessingMode.STREAMED,
    request_trailer_mode=ProcessingMode.SKIP, response_trailer_mode=ProcessingMode.SKIP)
"""The filter's mode plus the response body, chunk by chunk: asked per request (``mode_override``, allowed by
the bootstrap's ``allow_mode_override``) only for requests whose usage must be read."""


WATCH_RESPONSE_HEADERS = ProcessingMode(
    request_header_mode=ProcessingMode.SEND, response_header_mode=ProcessingMode.SEND,
    request_body_mode=ProcessingMode.BUFFERED, response_body_mode=ProcessingMode.NONE,
    request_trailer_mode=ProcessingMode.SKIP, response_trailer_mode=ProcessingMode.SKIP)
"""The response headers come to extproc, which then asks for the body only if the model name must be restored
(Envoy honours ``mode_override`` only in answers to a headers message, and the model is known after the
request body)."""
WATCH_RESPONSE_HEADERS_AND_BODY = ProcessingMode(
    request_header_mode=ProcessingMode.SEND, response_header_mode=ProcessingMode.SEND,
    request_body_mode=ProcessingMode.BUFFERED, response_body_mode=ProcessingMode.STREAMED,
    request_trailer_mode=ProcessingMode.SKIP, response_trailer_mode=ProcessingMode.SKIP)


def continue_headers(remove: Iterable[str] = (), watch_response: bool = False,
                     watch_response_headers: bool = False) -> ProcessingResponse:
    mutation = _mutation(remove)
    common = CommonResponse(header_mutation=mutation) if mutation else CommonResponse()
    answer = ProcessingResponse(request_headers=HeadersResponse(response=common))
    if watch_response and watch_response_headers:
        answer.mode_override.CopyFrom(WATCH_RESPONSE_HEADERS_AND_BODY)
    elif watch_response:
        answer.mode_override.CopyFrom(WATCH_RESPONSE_BODY)
    elif watch_response_headers:
        answer.mode_override.CopyFrom(WATCH_RESPONSE_HEADERS)
    return answer


def continue_response_headers(rewrite_body: bool = False, body_watched: bool = False) -> ProcessingResponse:
    """Pass the response headers on; with ``rewrite_body`` drop ``content-length`` (the body's length changes,
    Envoy then frames it itself) and ask for the body unless it already comes (``body_watched``)."""
    if not rewrite_body:
        return ProcessingResponse(response_headers=HeadersResponse())
    common = CommonResponse(header_mutation=HeaderMutation(remove_headers=["content-length"]))
    answer = ProcessingResponse(response_headers=HeadersResponse(response=common))
    if not body_watched:
        answer.mode_override.CopyFrom(WATCH_RESPONSE_BODY)
    return answer


_PASS_CHUNK = ProcessingResponse(response_body=BodyResponse())
"""The answer to most chunks of a watched response, built once (never mutated: gRPC only serialises it)."""


def continue_response_body(replacement: bytes | None = None) -> ProcessingResponse:
    """Pass a response chunk on, or send ``replacement`` instead of it."""
    if replacement is None:
        return _PASS_CHUNK
    return ProcessingResponse(response_body=BodyResponse(response=CommonResponse(
        body_mutation=BodyMutation(body=replacement))))


def continue_body(remove: Iterable[str] = ()) -> ProcessingResponse:
    """Let the request body go on upstream, without ``remove`` and ``NEVER_UPSTREAM``."""
    mutation = _mutation(_upstream_removals(remove))
    return ProcessingResponse(request_body=BodyResponse(response=CommonResponse(header_mutation=mutation)))


def continue_trailers() -> ProcessingResponse:
    return ProcessingResponse(request_trailers=TrailersResponse())


def routed_body(decision: Decision, remove: Iterable[str] = (),
                extra_headers: Iterable[tuple[str, str]] = (), new_body: bytes | None = None,
                header_pin: bool = False) -> ProcessingResponse:
    """Send the request to the decision's pool (cluster header + route re-evaluation) and pin its worker;
    ``new_body`` replaces the request body (with a matching content-length). ``header_pin`` also names the
    worker in the ``x-gateway-destination-endpoint`` header, for gateways whose ``ORIGINAL_DST`` cluster reads
    it (one ``ip:port``: that cluster takes no fallback list); off, the pin is in metadata only."""
    extra = list(extra_headers)
    if header_pin:
        extra.append((DESTINATION_ENDPOINT_KEY, decision.endpoint))
    if new_body is not None:
        extra.append(("content-length", str(len(new_body))))
    setting = {CLUSTER_HEADER, *(k for k, _ in extra)}
    mutation = _mutation(
        [h for h in _upstream_removals(remove) if h not in setting],
        [_header(CLUSTER_HEADER, decision.cluster), *(_header(k, v) for k, v in extra)],
    )
    pin = Struct()
    pin.fields[LB_METADATA_NAMESPACE].struct_value.fields[DESTINATION_ENDPOINT_KEY].string_value = decision.pin
    common = CommonResponse(header_mutation=mutation, clear_route_cache=True)
    if new_body is not None:
        common.body_mutation.body = new_body
    return ProcessingResponse(request_body=BodyResponse(response=common), dynamic_metadata=pin)


def extend_timeout(seconds: float) -> ProcessingResponse:
    """Ask Envoy to wait this long for the next answer (bounded by the filter's ``max_message_timeout``),
    sent before holding a request."""
    whole = int(seconds)
    return ProcessingResponse(override_message_timeout=Duration(seconds=whole,
                                                                nanos=int((seconds - whole) * 1e9)))


def json_answer(status: int, body: bytes, headers: Iterable[tuple[str, str]] = (), details: str = "") -> (
        ProcessingResponse):
    mutation = HeaderMutation(set_headers=[_header("content-type", "application/json"),
                                           *(_header(k, v) for k, v in headers)])
    return ProcessingResponse(immediate_response=ImmediateResponse(
        status=HttpStatus(code=status),  # type: ignore[arg-type]
        headers=mutation, body=body, details=details,
    ))


def error_answer(error: ApiError) -> ProcessingResponse:
    headers = [("retry-after", str(error.retry_after_s))] if error.retry_after_s is not None else []
    return json_answer(error.status, error.body(), headers, details=f"poolgate_{error.code or error.type}")


def model_list_answer(models: Iterable[str | ModelCard], created: int) -> ProcessingResponse:
    data = []
    for model in models:
        card = ModelCard(model) if isinstance(model, str) else model
        entry: dict[str, object] = {"id": card.id, "object": "model", "created": created, "owned_by": "poolgate"}
        if card.max_model_len is not None:
            entry["max_model_len"] = card.max_model_len
        if card.precision is not None:
            entry["precision"] = card.precision
        data.append(entry)
    return json_answer(200, orjson.dumps({"object": "list", "data": data}), details="poolgate_model_list")

