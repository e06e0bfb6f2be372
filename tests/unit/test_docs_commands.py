"""The commands the hand-written docs show exist as shown.

Every ``poolgate SUBCOMMAND --flag`` in README.md, docs/*.md and envoy/README.md (code spans and code
blocks) names a subcommand and flags that its parser defines; every ``poolgate bench NAME`` names a
benchmark of the checkout and flags that benchmark takes; the ``vllm serve`` example of
docs/gpu-workers.md is what the local backend builds. The generated docs (configuration.md, metrics.md)
have tests of their own.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re
from pathlib import Path

import pytest

from controller.local_backend import worker_command
from poolgate.bench_cli import available
from poolgate.cli import SUBCOMMANDS
from poolgate.kernel.config import Config

ROOT = Path(__file__).resolve().parents[2]
GENERATED = {"configuration.md", "metrics.md"}
DOCS = [ROOT / "README.md", ROOT / "envoy" / "README.md",
        *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in GENERATED)]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
COMMAND = re.compile(r"\bpoolgate (" + "|".join(SUBCOMMANDS) + r")\b(.*)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def _snippets(text: str) -> list[str]:
    """Code block lines and inline code spans: where the docs show commands."""
    lines = [line for block in FENCE.findall(text) for line in block.splitlines()]
    prose = FENCE.sub("", text)
    return lines + [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", prose)]


def documented_commands() -> list[tuple[str, str, str]]:
    """(doc, subcommand, the rest of its code span or line) for every ``poolgate SUBCOMMAND`` shown."""
    found = []
    for doc in DOCS:
        for snippet in _snippets(doc.read_text()):
            for match in COMMAND.finditer(snippet):
                found.append((doc.relative_to(ROOT).as_posix(), match.group(1), match.group(2)))
    return found


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    options: set[str] = set()
    for action in parser._actions:
        options.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                options |= _option_strings(sub)
    return options


def subcommand_options(name: str) -> set[str]:
    parser = argparse.ArgumentParser(prog=f"poolgate {name}")
    importlib.import_module(SUBCOMMANDS[name][0]).add_arguments(parser)
    return _option_strings(parser)


def bench_options(name: str) -> set[str]:
    """The flags a benchmark's own parser prints in its help."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        importlib.import_module(f"bench.{name}").main(["--help"])
    return set(FLAG.findall(out.getvalue()))


def test_the_docs_show_commands() -> None:
    shown = {sub for _, sub, _ in documented_commands()}
    assert {"up", "status", "agent", "bench", "tenant", "config"} <= shown


@pytest.mark.parametrize(("doc", "subcommand", "rest"), documented_commands())
def test_documented_flags_exist(doc: str, subcommand: str, rest: str) -> None:
    words = rest.split()
    benchmark = words[0] if subcommand == "bench" and words and words[0].islower() else None
    if benchmark is not None:  # not a placeholder such as NAME
        assert benchmark in available(), f"{doc}: no benchmark {benchmark!r}; known: {', '.join(available())}"
        known = bench_options(benchmark)
    else:
        known = subcommand_options(subcommand)
    unknown = set(FLAG.findall(rest)) - known - {"--help"}
    assert not unknown, f"{doc}: `poolgate {subcommand}{rest}` shows flags it does not take: {sorted(unknown)}"


def test_vllm_serve_example_is_what_the_controller_runs() -> None:
    config = Config.model_validate({
        "pools": [{"name": "chat", "model": "llama-3.1-8b-instruct", "max_model_len": 16384}],
        "workers": [{"id": "chat-1", "pool": "chat", "backend": "vllm",
                     "model_path": "meta-llama/Llama-3.1-8B-Instruct", "gpus": [0, 1]}],
    })
    command, env = worker_command(config, config.workers[0], 8001)
    line = " ".join([f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}", *command])
    doc = (ROOT / "docs" / "gpu-workers.md").read_text()
    examples = [" ".join(block.replace("\\\n", " ").split()) for block in FENCE.findall(doc)]
    assert line in examples
