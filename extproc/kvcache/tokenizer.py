"""A request's prompt token ids as the engine makes them: the served model's chat template and tokenizer.

The index keys blocks by token ids, so a lookup must tokenise exactly as the engine did:

- simulated models: the simulator's own template and tokenizer (``poolgate.kernel.sim_tokenizer``);
- real models: a local ``tokenizer.json`` (the ``tokenizers`` package; never a download) and the pool's
  chat template, given as format strings: ``prefix`` once, ``message`` per message with ``{role}`` and
  ``{content}``, ``reply`` to prime the answer (Llama-3: ``<|begin_of_text|>``,
  ``<|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|>``,
  ``<|start_header_id|>assistant<|end_header_id|>\\n\\n``). Jinja templates with logic (tools, system
  defaults) are not rendered: write the format strings the template produces for plain chat.

A body that is not a plain chat or completion (tools, images, several prompts) gives None: no precise
lookup, the scheduler estimates. Measured (``bench/kv_index.py``): the simulated tokenizer takes 5-30 ms for
a 16k-token prompt (idle to loaded machine), far over the 0.2 ms an event-loop step may take, so ``lookup``
tokenises long prompts in a worker thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from poolgate.kernel import sim_tokenizer
from poolgate.kernel.errors import PoolgateError

Messages = tuple[tuple[str, str], ...]


class TokenizerError(PoolgateError):
    """A configured tokenizer cannot be loaded (raised at start-up)."""


class PromptTokenizer(Protocol):
    def chat(self, messages: Messages) -> list[int]: ...

    def text(self, prompt: str) -> list[int]: ...


def chat_messages(data: Mapping[str, Any]) -> Messages | None:
    """(role, text) per message, text parts joined by newlines as the engine joins them; None if any
    message is not plain text."""
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    out: list[tuple[str, str]] = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            return None
        content = message.get("content")
        if content is None or isinstance(content, str):
            out.append((message["role"], content or ""))
        elif isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                               and isinstance(p.get("text"), str) for p in content):
            out.append((message["role"], "\n".join(p["text"] for p in content)))
        else:
            return None
    return tuple(out)


def prompt_token_ids(data: Mapping[str, Any], tokenizer: PromptTokenizer) -> list[int] | None:
    """The token ids the engine will see for a chat or completions body, or None when unknown."""
    if "messages" in data:
        messages = chat_messages(data)
        return None if messages is None else tokenizer.chat(messages)
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.text(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in prompt):
        return list(prompt)
    return None


class SimTokenizer:
    """The simulated worker's template and tokenizer."""

    def chat(self, messages: Messages) -> list[int]:
        return self.text(sim_tokenizer.render_chat(messages))

    def text(self, prompt: str) -> list[int]:
        return sim_tokenizer.token_ids(sim_tokenizer.tokenize(prompt))


@dataclass(frozen=True)
class ChatTemplate:
    message: str
    reply: str
    prefix: str = ""

    def render(self, messages: Sequence[tuple[str, str]]) -> str:
        body = "".join(self.message.format(role=role, content=content) for role, content in messages)
        return f"{self.prefix}{body}{self.reply}"


class LocalTokenizer:
    """A real model's ``tokenizer.json`` from a local path and its chat template as format strings.

    The template's special tokens are in the rendered text, so it is encoded without adding special
    tokens again; a completions prompt gets them as vLLM adds them (``add_special_tokens=True``)."""

    def __init__(self, path: str, template: ChatTemplate) -> None:
        file = Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise TokenizerError(f"no tokenizer.json at {path!r}")
        from tokenizers import Tokenizer

        try:
            self._tokenizer = Tokenizer.from_file(str(file))
        except Exception as error:  # the library raises its own exception types for unreadable files
            raise TokenizerError(f"cannot load {file}: {error}") from error
        self._template = template

    def chat(self, messages: Messages) -> list[int]:
        return list(self._tokenizer.encode(self._template.render(messages), add_special_tokens=False).ids)

    def text(self, prompt: str) -> list[int]:
        return list(self._tokenizer.encode(prompt, add_special_tokens=True).ids)
