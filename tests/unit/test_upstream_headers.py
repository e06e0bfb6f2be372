"""The client's API key never reaches a worker: every answer that lets a request go upstream removes it."""

from __future__ import annotations

from extproc import answers
from extproc.request import RequestFacts
from extproc.scheduling import Decision, PickRequest
from poolgate.kernel.routing import CLUSTER_HEADER


def decision() -> Decision:
    return Decision(worker_id="w1", pool="chat", cluster="pool-chat", endpoint="10.0.0.1:8000")


def test_routed_request_drops_the_authorization_header() -> None:
    answer = answers.routed_body(decision(), ("x-gateway-destination-endpoint",))
    removed = list(answer.request_body.response.header_mutation.remove_headers)
    assert removed.count("authorization") == 1 and "x-gateway-destination-endpoint" in removed


def test_passthrough_body_drops_the_authorization_header() -> None:
    assert "authorization" in answers.continue_body().request_body.response.header_mutation.remove_headers


def test_a_header_the_answer_sets_is_not_also_removed() -> None:
    answer = answers.routed_body(decision(), ("authorization",), extra_headers=[("x-poolgate-tenant", "acme")])
    mutation = answer.request_body.response.header_mutation
    assert list(mutation.remove_headers) == ["authorization"]
    assert {h.header.key for h in mutation.set_headers} == {CLUSTER_HEADER, "x-poolgate-tenant"}


def test_pick_request_defaults_to_the_highest_class() -> None:
    facts = RequestFacts("/v1/chat/completions", "POST", "m")
    assert PickRequest(facts, 1, 1, 1, "short_chat").priority == 0
