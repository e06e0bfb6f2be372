"""The endpoints extproc routes by model, one request-parsing module each, declared in ``ENDPOINTS``.

``chat`` and ``completions``; ``responses`` (the Responses API); ``pooling`` (embeddings, score, rerank);
``tokenizer`` (tokenize, detokenize); ``audio`` (transcriptions, translations: a multipart form, ``multipart``).
A new endpoint is a module here (its path, its prompt's measurement, its ``Endpoint`` declaration) and its
entry below; the pipeline's stages read the declaration (the estimate: ``chat_template`` and ``cost``; the
GenAI metrics: ``operation``; resolve: ``pool_tasks``, ``form``). ``path_fate`` says what happens to any other
path: ``GET /v1/models`` is answered by extproc, any other ``/v1/…`` path or method is an OpenAI-style 404
(it would otherwise reach a random worker), and the rest (``/health``, ``/metrics``) passes through untouched.
"""

from collections.abc import Mapping
from types import MappingProxyType
from typing import Literal

from extproc.endpoints import audio, chat, completions, pooling, responses, tokenizer
from extproc.endpoints.base import Endpoint, Measured
from extproc.endpoints.chat import CHAT_PATH
from extproc.endpoints.completions import COMPLETIONS_PATH

_DECLARED = (chat.ENDPOINT, completions.ENDPOINT, responses.ENDPOINT, pooling.EMBEDDINGS, pooling.SCORE,
             pooling.RERANK, tokenizer.TOKENIZE, tokenizer.DETOKENIZE, audio.TRANSCRIPTIONS, audio.TRANSLATIONS)
ENDPOINTS: Mapping[str, Endpoint] = MappingProxyType({path: e for e in _DECLARED for path in e.paths})
"""Path → endpoint; every one takes POST."""
OUTSIDE_V1 = tuple(sorted(path for path in ENDPOINTS if not path.startswith("/v1/")))
"""Routed paths outside ``/v1/`` (vLLM serves them there): Envoy's routes must send them through extproc."""
MODELS_PATH = "/v1/models"
PathFate = Literal["routed", "model_list", "unknown", "passthrough"]


def path_fate(method: str, path: str) -> PathFate:
    if method == "POST" and path in ENDPOINTS:
        return "routed"
    if method == "GET" and path == MODELS_PATH:
        return "model_list"
    if path.startswith("/v1/") or path == "/v1" or path in ENDPOINTS:
        return "unknown"
    return "passthrough"


__all__ = ["CHAT_PATH", "COMPLETIONS_PATH", "ENDPOINTS", "MODELS_PATH", "OUTSIDE_V1", "Endpoint", "Measured",
           "path_fate"]
