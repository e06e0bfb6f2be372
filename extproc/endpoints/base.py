"""What an endpoint declares: its path, how its prompt is measured, and how the pipeline treats it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from extproc.endpoints.cost import EndpointCost
from extproc.errors import ApiError
from poolgate.kernel.config import PoolTask

GENERATE: frozenset[PoolTask] = frozenset({"generate"})


class Measured(NamedTuple):
    """The prompt of one request as routing needs it."""

    chars: int
    """Characters of prompt text."""
    token_ids: int
    """Tokens known exactly: given as ids, or fixed by the endpoint (an audio clip's encoder positions)."""
    messages: int
    parts: tuple[str, ...]
    """The prompt's text pieces in order, for tokenizers and affinity."""
    cost: EndpointCost | None = None
    """How the endpoint's tokens are counted where chat's rule does not fit (``cost``)."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    path: str
    operation: str
    """``gen_ai.operation.name`` of its requests (the GenAI conventions' well-known value; empty: none fits)."""
    measure: Callable[[dict[str, Any]], Measured | ApiError]
    """Validates the body's prompt field the way the OpenAI API does and measures it."""
    chat_template: bool = False
    """The engine wraps its messages in a chat template: the prompt estimate adds the template's overhead."""
    aliases: tuple[str, ...] = ()
    """Other paths vLLM serves it on (``/v1/score`` beside ``/score``)."""
    pool_tasks: frozenset[PoolTask] = GENERATE
    """Kinds of pool whose model serves it (``PoolSpec.task``); a model of another kind is refused (400)."""
    max_tokens_fields: tuple[str, ...] = ("max_completion_tokens", "max_tokens")
    """Body fields that bound the output, first present wins."""
    usage_in_stream: bool = False
    """Its streams always end with their usage: nothing is asked on the client's behalf."""
    form: bool = False
    """The body is a multipart form (``model`` is a form field), not JSON."""

    @property
    def paths(self) -> tuple[str, ...]:
        return (self.path, *self.aliases)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def content_texts(content: Any) -> list[str]:
    """The texts of a message's content: a string, or the ``text`` of each part (other parts hold none)."""
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)]
    return []
