"""The OpenAI wire format as vLLM serves it: parse request bodies, build response bodies.

Pure functions over JSON-shaped values. Every client mistake becomes one ``WorkerApiError`` carrying the
HTTP status and vLLM's error body ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from poolgate.kernel.errors import PoolgateError
from simworker import lengths, tokens
from simworker.engine import FinishReason

ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError",
               503: "ServiceUnavailableError"}
RequestKind = Literal["chat", "completion"]
SEED_RANGE = (-(2**63), 2**63 - 1)
"""vLLM's bounds on ``seed``: a 64-bit signed integer (``torch.long``)."""


class WorkerApiError(PoolgateError):
    """An answer of the simulated vLLM's OpenAI API that is an error: status, message, the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "APIError"),
                          "param": self.param, "code": self.status}}


@dataclass(frozen=True)
class GenerationRequest:
    kind: RequestKind
    model: str | None
    prompt_tokens: tuple[str, ...]
    max_tokens: int | None
    min_tokens: int
    ignore_eos: bool
    stream: bool
    include_usage: bool
    seed: int | None = None


@dataclass(frozen=True)
class GenerationPlan:
    """What the simulated model will do with a request: how many tokens and why it stops."""

    prompt_tokens: int
    output_target: int
    finish_reason: FinishReason
    text_seed: int


def parse_chat(body: object) -> GenerationRequest:
    fields = _object(body)
    messages = fields.get("messages")
    if not isinstance(messages, list) or not messages:
        raise WorkerApiError(400, "'messages' must be a non-empty list of messages", "messages")
    rendered = tokens.render_chat([_message(m, i) for i, m in enumerate(messages)])
    max_tokens = _optional_int(fields, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _optional_int(fields, "max_tokens", 1)
    return _generation("chat", fields, tuple(tokens.tokenize(rendered)), max_tokens)


def parse_completion(body: object) -> GenerationRequest:
    fields = _object(body)
    if "prompt" not in fields:
        raise WorkerApiError(400, "'prompt' is required", "prompt")
    prompt = fields["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        prompt_tokens = tuple(tokens.tokenize(prompt))
    elif isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        prompt_tokens = tuple(str(t) for t in prompt)
    else:
        raise WorkerApiError(400, "'prompt' must be a string or a list of token ids (batches of several "
                            "prompts are not supported)", "prompt")
    if not prompt_tokens:
        raise WorkerApiError(400, "the prompt is empty", "prompt")
    return _generation("completion", fields, prompt_tokens, _optional_int(fields, "max_tokens", 1))


def plan_generation(request: GenerationRequest, max_model_len: int, model: str | None = None) -> GenerationPlan:
    """Apply vLLM's length rules and decide the output length; too long requests are 400s.

    The model stops at its natural length (``lengths``: EOS included, as vLLM counts it) unless the cap
    comes first: ``max_tokens``, or without it the room left in ``max_model_len``; that cap ends it with
    "length". ``ignore_eos`` runs to the cap; ``min_tokens`` holds the EOS back until then. ``model`` is
    the served name (default: the request's ``model`` field), part of the seed.
    """
    prompt_len = len(request.prompt_tokens)
    field = "messages" if request.kind == "chat" else "prompt"
    if prompt_len >= max_model_len:
        raise WorkerApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, your "
                            f"request has {prompt_len} input tokens. Please reduce the length of the input.",
                       field)
    if request.max_tokens is not None and prompt_len + request.max_tokens > max_model_len:
        raise WorkerApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                            f"requested {prompt_len + request.max_tokens} tokens ({prompt_len} in the "
                            f"{field}, {request.max_tokens} in the completion). Please reduce the length "
                            f"of the {field} or completion.", "max_tokens")
    limit = request.max_tokens if request.max_tokens is not None else max_model_len - prompt_len
    seed = lengths.request_seed(model if model is not None else request.model or "", request.prompt_tokens,
                                request.seed)
    kind = lengths.task_kind(request.kind == "chat", prompt_len)
    natural = max(lengths.natural_output_length(kind, seed), request.min_tokens)
    if request.ignore_eos or natural > limit:
        return GenerationPlan(prompt_len, limit, "length", seed)
    return GenerationPlan(prompt_len, natural, "stop", seed)


def new_request_id(kind: RequestKind) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def generated_text(seed: int, start: int, end: int) -> str:
    return "".join(tokens.filler_token(seed, index) for index in range(start, end))


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def full_response(kind: RequestKind, request_id: str, model: str, created: int, text: str,
                  finish_reason: str, prompt_tokens: int, completion_tokens: int) -> dict[str, object]:
    choice: dict[str, object]
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text, "tool_calls": []},
                  "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                  "stop_reason": None}
    return {"id": request_id, "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": created, "model": model, "choices": [choice],
            "usage": usage(prompt_tokens, completion_tokens)}


def stream_chunk(kind: RequestKind, request_id: str, model: str, created: int, text: str,
                 finish_reason: str | None, first: bool = False) -> dict[str, object]:
    choice: dict[str, object]
    if kind == "chat":
        delta: dict[str, object] = {"role": "assistant", "content": text} if first else {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                  "stop_reason": None}
    return {"id": request_id, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
            "created": created, "model": model, "choices": [choice]}


def usage_chunk(kind: RequestKind, request_id: str, model: str, created: int, prompt_tokens: int,
                completion_tokens: int) -> dict[str, object]:
    return {"id": request_id, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
            "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


def model_list(model: str, root: str, max_model_len: int, created: int | None = None) -> dict[str, object]:
    card = {"id": model, "object": "model", "created": created or int(time.time()), "owned_by": "vllm",
            "root": root, "parent": None, "max_model_len": max_model_len, "permission": []}
    return {"object": "list", "data": [card]}


def _object(body: object) -> Mapping[str, object]:
    if not isinstance(body, dict):
        raise WorkerApiError(400, "the request body must be a JSON object")
    return body


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional_int(fields: Mapping[str, object], name: str, minimum: int) -> int | None:
    value = fields.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise WorkerApiError(400, f"'{name}' must be an integer, got {value!r}", name)
    if value < minimum:
        raise WorkerApiError(400, f"'{name}' must be at least {minimum}, got {value}", name)
    return value


def _optional_bool(fields: Mapping[str, object], name: str) -> bool:
    value = fields.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise WorkerApiError(400, f"'{name}' must be a boolean, got {value!r}", name)
    return value


def _message(message: object, index: int) -> tuple[str, str]:
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise WorkerApiError(400, f"{param} must be an object with 'role' and 'content'", param)
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or not role:
        raise WorkerApiError(400, f"{param}.role must be a non-empty string", f"{param}.role")
    if content is None or isinstance(content, str):
        return role, content or ""
    if isinstance(content, list):
        texts = [part.get("text") for part in content if isinstance(part, dict) and part.get("type") == "text"]
        if len(texts) == len(content) and all(isinstance(text, str) for text in texts):
            return role, "\n".join(str(text) for text in texts)
    raise WorkerApiError(400, f"{param}.content must be a string or a list of text parts", f"{param}.content")


def _generation(kind: RequestKind, fields: Mapping[str, object], prompt_tokens: tuple[str, ...],
                max_tokens: int | None) -> GenerationRequest:
    model = fields.get("model")
    if model is not None and not isinstance(model, str):
        raise WorkerApiError(400, f"'model' must be a string, got {model!r}", "model")
    n = _optional_int(fields, "n", 1)
    if n is not None and n != 1:
        raise WorkerApiError(400, "only n=1 is supported by this server", "n")
    stream = _optional_bool(fields, "stream")
    stream_options = fields.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not stream:
            raise WorkerApiError(400, "Stream options can only be defined when `stream=True`.", "stream_options")
        if not isinstance(stream_options, dict):
            raise WorkerApiError(400, "'stream_options' must be an object", "stream_options")
        include_usage = _optional_bool(stream_options, "include_usage")
    min_tokens = _optional_int(fields, "min_tokens", 0) or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise WorkerApiError(400, f"min_tokens ({min_tokens}) must be <= max_tokens ({max_tokens})", "min_tokens")
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        value = fields.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise WorkerApiError(400, f"'{name}' must be a number, got {value!r}", name)
    seed = fields.get("seed")
    if seed is not None and not (isinstance(seed, int) and not isinstance(seed, bool)
                                 and SEED_RANGE[0] <= seed <= SEED_RANGE[1]):
        raise WorkerApiError(400, f"'seed' must be a 64-bit integer, got {seed!r}", "seed")
    return GenerationRequest(kind=kind, model=model, prompt_tokens=prompt_tokens, max_tokens=max_tokens,
                             min_tokens=min_tokens, ignore_eos=_optional_bool(fields, "ignore_eos"),
                             stream=stream, include_usage=include_usage, seed=seed)
