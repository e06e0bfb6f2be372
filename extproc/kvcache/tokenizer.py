"""A request's prompt token ids as the engine makes them: the served model's chat template and tokenizer.

The index keys blocks by token ids, so a lookup must tokenise exactly as the engine did:

- simulated models: the simulator's own template and tokenizer (``poolgate.kernel.sim_tokenizer``);
- real models: a local ``tokenizer.json`` (the ``tokenizers`` package; never a download) and the model's own
  Jinja chat template from the same directory (``tokenizer_config.json`` → ``chat_template``, or
  ``chat_template.jinja``), rendered as vLLM renders it (``chat_template``). Only a model without a template
  uses the pool's format strings: ``prefix`` once, ``message`` per message with ``{role}`` and ``{content}``,
  ``reply`` to prime the answer.

The rendered chat is encoded without adding special tokens (the template wrote them), a completions prompt
with them, as vLLM does. Text parts of a message are joined by newlines, as vLLM passes them to a template
that takes a string. A body that is not a plain chat or completion (tools, tool calls, images, several prompts)
gives None: no precise lookup, the scheduler estimates. Measured (``bench/kv_index.py``): the simulated tokenizer
takes 5-30 ms for a 16k-token prompt (idle to loaded machine), far over the 0.2 ms an event-loop step may take,
so ``lookup`` tokenises long prompts in a worker thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from extproc.kvcache.chat_template import CONFIG_FILE, TEMPLATE_FILE, ChatTemplateError, load_chat_template
from poolgate.kernel import sim_tokenizer
from poolgate.kernel.errors import PoolgateError

Messages = tuple[tuple[str, str], ...]


class TokenizerError(PoolgateError):
    """A configured tokenizer cannot be loaded (raised at start-up)."""


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A chat body as the template sees it: (role, text) per message and the request's template switches."""

    messages: Messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """The request's ``chat_template_kwargs`` (e.g. ``enable_thinking``)."""


class PromptTokenizer(Protocol):
    def chat(self, prompt: ChatPrompt) -> list[int]: ...

    def text(self, prompt: str) -> list[int]: ...


def chat_messages(data: Mapping[str, Any]) -> Messages | None:
    """(role, text) per message, text parts joined by newlines as the engine joins them; None if any
    message is not plain text or carries tool calls."""
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    out: list[tuple[str, str]] = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or message.get("tool_calls"):
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


def chat_prompt(data: Mapping[str, Any]) -> ChatPrompt | None:
    """The chat body's prompt, or None when it names tools (vLLM renders their full schemas) or odd switches."""
    messages = chat_messages(data)
    if messages is None or data.get("tools") or data.get("documents"):
        return None
    generation, final = data.get("add_generation_prompt", True), data.get("continue_final_message", False)
    kwargs = data.get("chat_template_kwargs") or {}
    if not isinstance(generation, bool) or not isinstance(final, bool) or not isinstance(kwargs, dict):
        return None
    return ChatPrompt(messages, generation, final, kwargs)


def prompt_token_ids(data: Mapping[str, Any], tokenizer: PromptTokenizer) -> list[int] | None:
    """The token ids the engine will see for a chat or completions body, or None when unknown."""
    if "messages" in data:
        prompt = chat_prompt(data)
        return None if prompt is None else tokenizer.chat(prompt)
    text = data.get("prompt")
    if isinstance(text, list) and len(text) == 1 and isinstance(text[0], str | list):
        text = text[0]
    if isinstance(text, str):
        return tokenizer.text(text)
    if isinstance(text, list) and text and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                               for t in text):
        return list(text)
    return None


class SimTokenizer:
    """The simulated worker's template and tokenizer."""

    def chat(self, prompt: ChatPrompt) -> list[int]:
        return self.text(sim_tokenizer.render_chat(prompt.messages))

    def text(self, prompt: str) -> list[int]:
        return sim_tokenizer.token_ids(sim_tokenizer.tokenize(prompt))


@dataclass(frozen=True)
class ChatTemplate:
    """Format strings for a model without a Jinja template (``pools[].tokenizer.message`` and friends)."""

    message: str
    reply: str
    prefix: str = ""

    def render(self, messages: Sequence[tuple[str, str]]) -> str:
        body = "".join(self.message.format(role=role, content=content) for role, content in messages)
        return f"{self.prefix}{body}{self.reply}"


class LocalTokenizer:
    """A real model's ``tokenizer.json`` from a local path, and its chat template: the model's own Jinja
    template from the same directory, else the pool's format strings (``fallback``); TokenizerError at
    start-up when it has neither."""

    def __init__(self, path: str, fallback: ChatTemplate | None = None) -> None:
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
        try:
            self._jinja = load_chat_template(file.parent)
        except ChatTemplateError as error:
            raise TokenizerError(str(error)) from error
        if self._jinja is None and fallback is None:
            raise TokenizerError(f"no chat template beside {file} ({CONFIG_FILE} has no chat_template and there is "
                                 f"no {TEMPLATE_FILE}): give the pool's tokenizer message/reply/prefix format strings")
        self._fallback = fallback
        self.uses_model_template = self._jinja is not None
        """Whether chat renders the model's own template (else the format strings)."""

    def chat(self, prompt: ChatPrompt) -> list[int]:
        return list(self._tokenizer.encode(self.render(prompt), add_special_tokens=False).ids)

    def render(self, prompt: ChatPrompt) -> str:
        if self._jinja is not None:
            return self._jinja.render([{"role": role, "content": content} for role, content in prompt.messages],
                                      prompt.add_generation_prompt, prompt.continue_final_message,
                                      prompt.template_kwargs)
        assert self._fallback is not None
        return self._fallback.render(prompt.messages)

    def text(self, prompt: str) -> list[int]:
        return list(self._tokenizer.encode(prompt, add_special_tokens=True).ids)
