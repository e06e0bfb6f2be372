"""The configuration reference, generated from the config schema itself and the scheduling plugin registry.

``python -m poolgate.config_doc > docs/configuration.md``. Walks the pydantic models of
``poolgate.kernel.config`` from ``Config`` down: every field with its type, default, bounds and the docstring
written under it in the source (pydantic keeps those only when asked, so they are read from the source
here); then every scheduling plugin extproc's registry holds, with its default weight and its own settings
model, so a new plugin's settings appear here without an edit. A test compares the committed file with this
output, so the reference cannot drift from the code.
"""

from __future__ import annotations

import ast
import inspect
import itertools
import json
import sys
import textwrap
import types
import typing
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from extproc.scheduling import PLUGINS, Registry
from poolgate.kernel import config as config_module

BOUNDS = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}


def field_docstrings(model: type[BaseModel]) -> dict[str, str]:
    """``name: type = …`` followed by a string literal: that string documents the field."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(model)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, following in itertools.pairwise(body):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(following.value.value)
    return docs


def _annotations(model: type[BaseModel]) -> dict[str, str]:
    """Field types as written in the source (readable, e.g. ``tuple[PoolSpec, ...]``)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(model)))
    return {node.target.id: ast.unparse(node.annotation) for node in tree.body[0].body  # type: ignore[attr-defined]
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}


def _nested_model(annotation: Any) -> tuple[type[BaseModel], str] | None:
    """The model a field holds, and how its path continues: ``.x`` (one), ``[].x`` (a list), ``.<key>.x``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, ""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (tuple, list) and args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
        return args[0], "[]"
    if origin is dict and len(args) == 2 and isinstance(args[1], type) and issubclass(args[1], BaseModel):
        return args[1], ".<name>"
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            nested = _nested_model(arg)
            if nested:
                return nested
    return None


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]
    elif info.default is PydanticUndefined:
        return "required"
    else:
        value = info.default
    if isinstance(value, BaseModel):
        return "see below"
    if isinstance(value, tuple) and value and isinstance(value[0], BaseModel):
        value = [item.model_dump() for item in value]
    if isinstance(value, tuple):
        value = list(value)
    return f"`{json.dumps(value, ensure_ascii=False)}`"


def _bounds(info: FieldInfo) -> str:
    parts = []
    for item in info.metadata:
        for attribute, symbol in BOUNDS.items():
            bound = getattr(item, attribute, None)
            if bound is not None:
                parts.append(f"{symbol} {bound:g}" if isinstance(bound, float) else f"{symbol} {bound}")
        if getattr(item, "min_length", None):
            parts.append(f"length ≥ {item.min_length}")
        if getattr(item, "pattern", None):
            parts.append(f"matches `{item.pattern}`")
    return ", ".join(parts)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def sections(model: type[BaseModel], path: str) -> Iterator[str]:
    """One Markdown section per model, parents before children."""
    docs = field_docstrings(model)
    written = _annotations(model)
    title = f"`{path}`" if path else "Top level"
    lines = [f"## {title}", ""]
    if model.__doc__ and model.__doc__ is not BaseModel.__doc__:
        lines += [inspect.cleandoc(model.__doc__), ""]
    lines += ["| field | type | default | meaning |", "|---|---|---|---|"]
    children: list[tuple[type[BaseModel], str]] = []
    for name, info in model.model_fields.items():
        meaning = docs.get(name, "")
        bounds = _bounds(info)
        if bounds:
            meaning = f"{meaning} ({bounds})" if meaning else bounds[0].upper() + bounds[1:]
        lines.append(f"| `{name}` | `{_cell(written.get(name, ''))}` | {_cell(_default(info))} | {_cell(meaning)} |")
        nested = _nested_model(info.annotation)
        if nested:
            child, joint = nested
            children.append((child, f"{path}.{name}{joint}".lstrip(".") if path else f"{name}{joint}"))
    yield "\n".join(lines) + "\n"
    for child, child_path in children:
        yield from sections(child, child_path)


def _summary(module_name: str) -> str:
    """The first sentence of a plugin module's docstring (it gives the plugin's formula)."""
    doc = inspect.cleandoc(sys.modules[module_name].__doc__ or "")
    first = " ".join(doc.split("\n\n")[0].split())
    return first.split(": ")[0].split(". ")[0].rstrip(".") if first else ""


def plugin_sections(registry: Registry) -> Iterator[str]:
    """The scheduling plugins: filters in the order they run, scorers with their default weight, then the
    settings of each plugin that has some of its own."""
    own: list[tuple[type[BaseModel], str]] = []

    def settings_path(kind: str, name: str, settings: type[BaseModel]) -> str:
        if not settings.model_fields:
            return "—"
        own.append((settings, f"scheduling.{kind}_settings.{name}"))
        return f"`scheduling.{kind}_settings.{name}`"

    lines = ["## Scheduling plugins", "",
             "What extproc's plugin registry holds. A plugin's own parameters go under "
             "`scheduling.filter_settings.<name>` or\n`scheduling.scorer_settings.<name>`; the values they "
             "share are fields of `scheduling` above.", "",
             "Filters, in the order they run:", "", "| filter | settings |", "|---|---|"]
    lines += [f"| `{name}` | {settings_path('filter', name, plugin.settings)} |"
              for name, plugin in registry.filters.items()]
    lines += ["", "Scorers, weighed by `scheduling.weights` (not set: the default weight here):", "",
              "| scorer | default weight | settings | what it scores |", "|---|---|---|---|"]
    lines += [f"| `{name}` | {plugin.default_weight:g} | {settings_path('scorer', name, plugin.settings)} | "
              f"{_cell(_summary(plugin.build.__module__))} |" for name, plugin in registry.scorers.items()]
    yield "\n".join(lines) + "\n"
    for model, path in own:
        yield from sections(model, path)


def render(registry: Registry = PLUGINS) -> str:
    head = ("# Configuration reference\n\n"
            "One YAML file configures every poolgate process (`poolgate config check FILE` validates it; errors "
            "name the\nfield path). Generated from the schema in `poolgate/kernel/config/` and extproc's scheduling "
            "plugins by "
            "`python -m poolgate.config_doc > docs/configuration.md`;\n"
            "do not edit by hand. `[]` marks a list item, `<name>` a key you choose.\n")
    return "\n".join([head, *sections(config_module.Config, ""), *plugin_sections(registry)])


if __name__ == "__main__":
    sys.stdout.write(render())
