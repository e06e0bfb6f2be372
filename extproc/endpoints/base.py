"""What an endpoint declares: its path, how its prompt is measured, and how the pipeline treats it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from extproc.errors import ApiError


class Measured(NamedTuple):
    """The prompt of one request as routing needs it."""

    chars: int
    """Characters of prompt text."""
    token_ids: int
    """Tokens given directly as ids."""
    messages: int
    parts: tuple[str, ...]
    """The prompt's text pieces in order, for tokenizers and affinity."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    path: str
    operation: str
    """``gen_ai.operation.name`` of its requests (the GenAI conventions' well-known value)."""
    measure: Callable[[dict[str, Any]], Measured | ApiError]
    """Validates the body's prompt field the way the OpenAI API does and measures it."""
    chat_template: bool = False
    """The engine wraps its messages in a chat template: the prompt estimate adds the template's overhead."""


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
