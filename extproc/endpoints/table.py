"""Every path poolgate routes by model, with its parser and the pool kinds that serve it.

``endpoint_for(method, path)`` gives the ``Endpoint`` of a routed request; ``classify_path`` also says what
to do with the rest: ``GET /v1/models`` is answered by extproc itself, any other ``/v1/…`` path or method is
an OpenAI-style 404 (it would otherwise reach a random worker), and paths outside ``/v1/`` that are not in the
table (``/health``, ``/metrics``…) pass through untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

from extproc.endpoints import paths
from extproc.endpoints.audio import parse_audio
from extproc.endpoints.multipart import FormPart, parse_form
from extproc.endpoints.pooling import parse_embeddings, parse_rerank, parse_score
from extproc.endpoints.responses import parse_responses
from extproc.endpoints.tokenizer import parse_detokenize, parse_tokenize
from extproc.errors import ApiError
from extproc.request import MODELS_PATH, RequestFacts, RequestHead, facts_from_data
from extproc.request import load_body as load_json
from poolgate.kernel.config import PoolTask

JsonParser: TypeAlias = Callable[[RequestHead, dict[str, Any]], "RequestFacts | ApiError"]
FormParser: TypeAlias = Callable[[RequestHead, tuple[FormPart, ...]], "RequestFacts | ApiError"]
GENERATE: frozenset[PoolTask] = frozenset({"generate"})
SCORING: frozenset[PoolTask] = frozenset({"embed", "score"})
ANY_POOL: frozenset[PoolTask] = frozenset({"generate", "embed", "score", "transcription"})


@dataclass(frozen=True, slots=True)
class Parsed:
    facts: RequestFacts
    data: dict[str, Any] | None = None
    """The JSON body as an object (the catalogue rewrites it), for JSON endpoints."""
    form: tuple[FormPart, ...] | None = None
    """The form's parts, for multipart endpoints."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    name: str
    """The endpoint family, a metric label value: ``chat``, ``embeddings``, ``rerank`` …"""
    pool_tasks: frozenset[PoolTask]
    """Kinds of pool whose model serves it (``PoolSpec.task``)."""
    parse_json: JsonParser | None = None
    parse_form: FormParser | None = None

    def parse(self, head: RequestHead, body: bytes) -> Parsed | ApiError:
        if self.parse_form is not None:
            form = parse_form(body, head.content_type)
            if isinstance(form, ApiError):
                return form
            parsed = self.parse_form(head, form)
            return parsed if isinstance(parsed, ApiError) else Parsed(parsed, form=form)
        assert self.parse_json is not None
        data = load_json(body)
        if isinstance(data, ApiError):
            return data
        facts = self.parse_json(head, data)
        return facts if isinstance(facts, ApiError) else Parsed(facts, data)


CHAT = Endpoint("chat", GENERATE, facts_from_data)
COMPLETIONS = Endpoint("completions", GENERATE, facts_from_data)
RESPONSES = Endpoint("responses", GENERATE, parse_responses)
EMBEDDINGS = Endpoint("embeddings", frozenset({"embed"}), parse_embeddings)
SCORE = Endpoint("score", SCORING, parse_score)
RERANK = Endpoint("rerank", SCORING, parse_rerank)
TOKENIZE = Endpoint("tokenize", ANY_POOL, parse_tokenize)
DETOKENIZE = Endpoint("detokenize", ANY_POOL, parse_detokenize)
TRANSCRIPTIONS = Endpoint("transcriptions", frozenset({"transcription"}), parse_form=parse_audio)
TRANSLATIONS = Endpoint("translations", frozenset({"transcription"}), parse_form=parse_audio)

ROUTED: dict[str, Endpoint] = {
    paths.CHAT_PATH: CHAT, paths.COMPLETIONS_PATH: COMPLETIONS, paths.RESPONSES_PATH: RESPONSES,
    paths.EMBEDDINGS_PATH: EMBEDDINGS, **dict.fromkeys(paths.SCORE_PATHS, SCORE),
    **dict.fromkeys(paths.RERANK_PATHS, RERANK), paths.TOKENIZE_PATH: TOKENIZE, paths.DETOKENIZE_PATH: DETOKENIZE,
    paths.TRANSCRIPTIONS_PATH: TRANSCRIPTIONS, paths.TRANSLATIONS_PATH: TRANSLATIONS,
}
"""Path → endpoint; every one takes POST."""

PathKind: TypeAlias = Literal["routed", "model_list", "unknown", "passthrough"]


def endpoint_for(method: str, path: str) -> Endpoint | None:
    return ROUTED.get(path) if method == "POST" else None


def classify_path(method: str, path: str) -> PathKind:
    if endpoint_for(method, path) is not None:
        return "routed"
    if path == MODELS_PATH and method == "GET":
        return "model_list"
    if path.startswith("/v1/") or path == "/v1" or path in ROUTED:
        return "unknown"
    return "passthrough"
