"""A model's own Jinja chat template, rendered as vLLM renders it (through ``transformers``), without either.

A real engine formats chat with the template in the model's ``tokenizer_config.json`` (``chat_template``, a
string or a list of named templates, ``default`` first) or in a ``chat_template.jinja`` beside it (newer
checkpoints), with the special tokens (``bos_token``, ``eos_token``, …) as variables. Templates trim
whitespace, add BOS, rename roles: a hand-written format string misses such details (seen against a real vLLM:
one prompt in four tokenised differently, by the spaces at either end of a message). So the router renders
the same template the same way:

- a sandboxed environment (``ImmutableSandboxedEnvironment``: a template is code from a model repository and
  may not reach Python objects or mutate its inputs) with ``trim_blocks`` and ``lstrip_blocks``, the
  ``loopcontrols`` extension, a ``{% generation %}`` block that renders its body, ``tojson`` without ASCII
  escaping, and the globals ``raise_exception`` and ``strftime_now``, as ``transformers`` sets them up;
- variables ``messages``, ``add_generation_prompt``, ``tools`` / ``documents`` (None), the special tokens,
  and the request's ``chat_template_kwargs``;
- ``continue_final_message`` cuts the text after the last message's content, as ``transformers`` does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from poolgate.kernel.errors import PoolgateError

CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(PoolgateError):
    """A model's chat template cannot be read or compiled (raised at start-up)."""


class _Generation(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}`` (``transformers`` marks assistant tokens with it): the body."""

    tags = {"generation"}  # noqa: RUF012 -- jinja2 declares it a plain set

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                       extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class JinjaChatTemplate:
    """One compiled template with the model's special tokens."""

    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"the chat template does not compile: {error}") from error
        self._special_tokens = dict(special_tokens)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               continue_final_message: bool = False, template_kwargs: Mapping[str, Any] | None = None) -> str:
        """The prompt text; a template's own ``raise_exception`` (a role it refuses) raises TemplateError."""
        variables: dict[str, Any] = {**self._special_tokens, **(template_kwargs or {})}
        variables.update(messages=[dict(m) for m in messages], tools=None, documents=None,
                         add_generation_prompt=add_generation_prompt and not continue_final_message)
        text = self._template.render(**variables)
        if continue_final_message and messages:
            text = _cut_after_final(text, str(messages[-1].get("content") or ""))
        return text


def _cut_after_final(text: str, final: str) -> str:
    """``transformers``' cut: keep the final message's leading spaces and, where the template kept them, its
    trailing ones too."""
    stripped = final.strip()
    if stripped not in text:
        raise jinja2.exceptions.TemplateError("continue_final_message: the final message is not in the rendered chat")
    at = text.rindex(stripped)
    if text[at:at + len(final.lstrip())] == final:
        return text[:at + len(final.lstrip())]
    return text[:at + len(stripped)]


def load_chat_template(model_dir: Path) -> JinjaChatTemplate | None:
    """The model's template from ``model_dir`` (``chat_template.jinja``, else ``tokenizer_config.json``), or None
    when it has none; ChatTemplateError when a file is there but unreadable."""
    config = _read_config(model_dir / CONFIG_FILE)
    specials = {name: token for name in SPECIAL_TOKENS if (token := _token_text(config.get(name))) is not None}
    jinja_file = model_dir / TEMPLATE_FILE
    if jinja_file.is_file():
        try:
            return JinjaChatTemplate(jinja_file.read_text(encoding="utf-8"), specials)
        except OSError as error:
            raise ChatTemplateError(f"cannot read {jinja_file}: {error}") from error
    source = _template_source(config.get("chat_template"))
    return None if source is None else JinjaChatTemplate(source, specials)


def _read_config(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ChatTemplateError(f"cannot read {file}: {error}") from error
    if not isinstance(data, dict):
        raise ChatTemplateError(f"{file} is not a JSON object")
    return data


def _template_source(value: object) -> str | None:
    """A template string, or the ``default`` (else the first) of a list of ``{name, template}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {item.get("name"): item.get("template") for item in value if isinstance(item, dict)}
        chosen = named.get("default", next(iter(named.values()), None))
        return chosen if isinstance(chosen, str) else None
    return None


def _token_text(value: object) -> str | None:
    """A special token as a string: written plain, or as a serialised ``AddedToken`` (``{"content": …}``)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None
