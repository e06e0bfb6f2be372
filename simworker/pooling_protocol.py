"""The pooling endpoints' wire format as vLLM serves it: embeddings, score and rerank.

Pure functions over JSON-shaped values, like ``protocol`` for generation. A client mistake is a
``WorkerApiError`` with vLLM's status and message.

The simulated model's vectors are a hashed bag of words: each token adds ±1 to a few coordinates chosen by
its hash, and the sum is L2-normalised (vLLM normalises embeddings by default). Texts that share words are
therefore close, so scores and rerank orders mean something in tests: ``score = cos(e1, e2)`` for an
embedding model (vLLM scores those by cosine similarity), ``(1 + cos) / 2`` for a cross-encoder, whose
scores vLLM returns as probabilities in [0, 1].
"""

from __future__ import annotations

import base64
import math
import struct
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from simworker import tokens
from simworker.protocol import WorkerApiError
from simworker.request_fields import content_text, json_object, model_field

COORDINATES_PER_TOKEN = 4


@dataclass(frozen=True, slots=True)
class EmbeddingRequest:
    model: str | None
    inputs: tuple[tuple[str, ...], ...]
    """Each input as its tokens (text tokenized, or token ids as strings)."""
    base64: bool
    dimensions: int | None


@dataclass(frozen=True, slots=True)
class ScoreRequest:
    model: str | None
    pairs: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]
    """(first, second) token sequences, one pair per score."""
    documents: tuple[str, ...] = ()
    """Rerank only: the documents, in the client's order."""
    top_n: int = 0
    """Rerank only: how many results to return (0 = all)."""


def parse_embeddings(body: object, embedding_dim: int) -> EmbeddingRequest:
    fields = json_object(body)
    if "messages" in fields:
        messages = fields["messages"]
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise WorkerApiError(400, "'messages' must be a non-empty list of messages", "messages")
        rendered = tokens.render_chat([(str(m.get("role", "")), content_text(m.get("content")))
                                       for m in messages])
        inputs: tuple[tuple[str, ...], ...] = (tuple(tokens.tokenize(rendered)),)
    else:
        inputs = _inputs(fields.get("input"))
    encoding = fields.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise WorkerApiError(400, f"'encoding_format' must be 'float' or 'base64', got {encoding!r}", "encoding_format")
    dimensions = fields.get("dimensions")
    if dimensions is not None:
        if not isinstance(dimensions, int) or isinstance(dimensions, bool) or not 1 <= dimensions <= embedding_dim:
            raise WorkerApiError(
                400, f"dimensions must be an integer between 1 and {embedding_dim}, got {dimensions!r}", "dimensions")
    return EmbeddingRequest(model_field(fields), inputs, encoding == "base64", dimensions)


def parse_score(body: object) -> ScoreRequest:
    """``text_1`` / ``text_2``: one of each, one against many, or many against as many."""
    fields = json_object(body)
    first, second = _texts(fields, "text_1"), _texts(fields, "text_2")
    if len(first) == 1:
        pairs = [(first[0], text) for text in second]
    elif len(first) == len(second):
        pairs = list(zip(first, second, strict=True))
    else:
        raise WorkerApiError(400, "text_1 and text_2 must be lists of the same length (or text_1 a single text)",
                             "text_1")
    return ScoreRequest(model_field(fields), tuple((_tokens(a), _tokens(b)) for a, b in pairs))


def parse_rerank(body: object) -> ScoreRequest:
    fields = json_object(body)
    query = fields.get("query")
    if not isinstance(query, str):
        raise WorkerApiError(400, "'query' must be a string", "query")
    documents = fields.get("documents")
    if not isinstance(documents, list) or not all(isinstance(d, str) for d in documents):
        raise WorkerApiError(400, "'documents' must be a list of strings", "documents")
    top_n = fields.get("top_n", 0)
    if not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0:
        raise WorkerApiError(400, f"'top_n' must be a non-negative integer, got {top_n!r}", "top_n")
    query_tokens = _tokens(query)
    return ScoreRequest(model_field(fields), tuple((query_tokens, _tokens(d)) for d in documents), tuple(documents),
                        top_n)


def check_lengths(sequences: Sequence[Sequence[str]], max_model_len: int) -> None:
    """vLLM refuses a pooling input longer than the model's context."""
    for sequence in sequences:
        if len(sequence) > max_model_len:
            raise WorkerApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                                f"requested {len(sequence)} tokens in the input for embedding generation. "
                                "Please reduce the length of the input.", "input")
        if not sequence:
            raise WorkerApiError(400, "an input is empty", "input")


def embed(sequence: Sequence[str], dim: int) -> list[float]:
    """The simulated model's normalised embedding of one token sequence."""
    vector = [0.0] * dim
    for token in sequence:
        digest = tokens.stable_hash(token)
        for k in range(COORDINATES_PER_TOKEN):
            coordinate = (digest >> (k * 12)) % dim
            vector[coordinate] += 1.0 if (digest >> (48 + k)) & 1 else -1.0
    return _normalised(vector)


def truncated(vector: Sequence[float], dimensions: int | None) -> list[float]:
    """Matryoshka truncation: the leading coordinates, normalised again."""
    return list(vector) if dimensions is None else _normalised(vector[:dimensions])


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def encode_base64(vector: Sequence[float]) -> str:
    """vLLM's base64 encoding: little-endian float32, what the openai SDK decodes by default."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


def usage(prompt_tokens: int) -> dict[str, object]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0,
            "prompt_tokens_details": None}


def embedding_response(model: str, vectors: Sequence[Sequence[float]], as_base64: bool,
                       prompt_tokens: int) -> dict[str, object]:
    data = [{"index": i, "object": "embedding", "embedding": encode_base64(v) if as_base64 else list(v)}
            for i, v in enumerate(vectors)]
    return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "data": data, "usage": usage(prompt_tokens)}


def score_response(model: str, scores: Sequence[float], prompt_tokens: int) -> dict[str, object]:
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": usage(prompt_tokens)}


def rerank_response(model: str, request: ScoreRequest, scores: Sequence[float],
                    prompt_tokens: int) -> dict[str, object]:
    """Most relevant first, cut to ``top_n``; usage counts every token read."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    if request.top_n:
        order = order[:request.top_n]
    results = [{"index": i, "document": {"text": request.documents[i]}, "relevance_score": scores[i]}
               for i in order]
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "usage": {"total_tokens": prompt_tokens},
            "results": results}


def _normalised(vector: Sequence[float]) -> list[float]:
    norm = math.sqrt(sum(x * x for x in vector))
    if norm == 0:
        return [1.0 / math.sqrt(len(vector))] * len(vector)
    return [x / norm for x in vector]




def _tokens(text: str) -> tuple[str, ...]:
    return tuple(tokens.tokenize(text))


def _texts(fields: Mapping[str, object], name: str) -> list[str]:
    value = fields.get(name)
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return list(value)
    raise WorkerApiError(400, f"'{name}' must be a string or a non-empty list of strings", name)


def _inputs(value: object) -> tuple[tuple[str, ...], ...]:
    """``input``: a string, a list of strings, a list of token ids, or a list of such lists."""
    if isinstance(value, str):
        return (_tokens(value),)
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return tuple(_tokens(v) for v in value)
        if all(_is_token_id(v) for v in value):
            return (tuple(str(v) for v in value),)
        if all(isinstance(v, list) and v and all(_is_token_id(t) for t in v) for v in value):
            return tuple(tuple(str(t) for t in v) for v in value)  # type: ignore[union-attr]
    raise WorkerApiError(400, "'input' must be a string, a list of strings, or token ids (a list of integers or a "
                        "list of such lists)", "input")


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
