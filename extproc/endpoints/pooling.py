"""The pooling endpoints: ``/v1/embeddings``, ``/score`` (``/v1/score``) and ``/rerank`` (``/v1/rerank``,
``/v2/rerank``), served by embedding or scoring (cross-encoder) models.

They are prefill-only: the model reads its inputs and returns vectors or scores, so the cost is the text
estimate of every sequence and no decode room (``output_tokens = 0``). Each embedding input, score pair or
query-document pair is its own sequence: the context limit applies to the longest one, the KV footprint to
all of them. A pair counts as query plus document (a cross-encoder reads them together; an embedding model
reads the query once, so this errs high for it). Pooling requests never stream, so their task class is
``short_chat`` or ``long_context`` by size.

Shapes: embeddings ``input`` is a string, a list of strings, a list of token ids or a list of such lists (or,
vLLM's chat form, ``messages``, counted without the template's overhead); score takes ``text_1`` / ``text_2``
(vLLM's names; ``queries`` / ``documents`` and ``data_1`` / ``data_2`` of newer releases too), each a string
or a list (one against many, or pairwise); rerank takes ``query`` and ``documents``. Items given as objects
(multimodal content) count by their text.
"""

from __future__ import annotations

from typing import Any

from extproc.endpoints.base import Endpoint, Measured, content_texts, is_int
from extproc.endpoints.cost import EndpointCost
from extproc.errors import ApiError, invalid_request
from poolgate.kernel.config import PoolTask

EMBEDDINGS_PATH = "/v1/embeddings"
SCORE_FIELDS = (("text_1", "text_2"), ("queries", "documents"), ("data_1", "data_2"))
SCORING: frozenset[PoolTask] = frozenset({"embed", "score"})


def measure_embeddings(data: dict[str, Any]) -> Measured | ApiError:
    if data.get("input") is None and isinstance(data.get("messages"), list):
        return _chat_form(data["messages"])
    sequences = _inputs(data.get("input"))
    if isinstance(sequences, ApiError):
        return sequences
    texts = [s for s in sequences if isinstance(s, str)]
    ids = [s for s in sequences if isinstance(s, int)]
    cost = EndpointCost(output_tokens=0, longest_chars=max(map(len, texts), default=0),
                        longest_token_ids=max(ids, default=0))
    return Measured(sum(map(len, texts)), sum(ids), 0, tuple(texts), cost)


def measure_score(data: dict[str, Any]) -> Measured | ApiError:
    names = next((pair for pair in SCORE_FIELDS if pair[0] in data or pair[1] in data), SCORE_FIELDS[0])
    first, second = _texts(data.get(names[0]), names[0]), _texts(data.get(names[1]), names[1])
    if isinstance(first, ApiError):
        return first
    if isinstance(second, ApiError):
        return second
    if len(first) != 1 and len(first) != len(second):
        return invalid_request(f"'{names[0]}' must hold one item or as many as '{names[1]}'.", names[0],
                               "invalid_value")
    return _pairs([(first[0] if len(first) == 1 else first[i], text) for i, text in enumerate(second)])


def measure_rerank(data: dict[str, Any]) -> Measured | ApiError:
    query = _texts(data.get("query"), "query")
    if isinstance(query, ApiError):
        return query
    documents = _texts(data.get("documents"), "documents")
    if isinstance(documents, ApiError):
        return documents
    return _pairs([(query[0], document) for document in documents])


def _pairs(pairs: list[tuple[str, str]]) -> Measured:
    joined = tuple(a + b for a, b in pairs)
    cost = EndpointCost(output_tokens=0, longest_chars=max(map(len, joined), default=0))
    return Measured(sum(map(len, joined)), 0, 0, joined, cost)


def _chat_form(messages: list[Any]) -> Measured | ApiError:
    if not messages or not all(isinstance(m, dict) for m in messages):
        return invalid_request("'messages' must be a non-empty array of objects.", "messages", "invalid_type")
    parts = tuple(text for message in messages for text in content_texts(message.get("content")))
    chars = sum(map(len, parts))
    return Measured(chars, 0, len(messages), parts, EndpointCost(output_tokens=0, longest_chars=chars))


def _inputs(value: Any) -> list[str | int] | ApiError:
    """Each sequence: its text, or (token ids) its length."""
    if isinstance(value, str):
        return [value]
    if value is None:
        return invalid_request("You must provide an 'input' parameter.", "input", "missing_input")
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return list(value)
        if all(is_int(v) for v in value):
            return [len(value)]
        if all(isinstance(v, list) and v and all(is_int(t) for t in v) for v in value):
            return [len(v) for v in value]
    return invalid_request("'input' must be a string, an array of strings, an array of token ids or an array of "
                           "token id arrays.", "input", "invalid_type")


def _texts(value: Any, name: str) -> list[str] | ApiError:
    """A string, an object with content, or a non-empty list of either, as texts."""
    items = value if isinstance(value, list) else [value]
    if value is None or not items:
        return invalid_request(f"You must provide a non-empty '{name}' parameter.", name, f"missing_{name}")
    texts: list[str] = []
    for item in items:
        if isinstance(item, str):
            texts.append(item)
        elif isinstance(item, dict):
            texts.append("".join(content_texts(item.get("content", [item]))))
        else:
            return invalid_request(f"'{name}' must be a string, an object or an array of them.", name,
                                   "invalid_type")
    return texts


EMBEDDINGS = Endpoint(EMBEDDINGS_PATH, "embeddings", measure_embeddings, pool_tasks=frozenset({"embed"}))
SCORE = Endpoint("/score", "", measure_score, aliases=("/v1/score",), pool_tasks=SCORING)
RERANK = Endpoint("/rerank", "", measure_rerank, aliases=("/v1/rerank", "/v2/rerank"), pool_tasks=SCORING)
