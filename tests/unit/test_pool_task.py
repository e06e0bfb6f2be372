"""Pools of embedding, scoring and speech-to-text models: validated in the config, started with vLLM's flags."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
import yaml

from controller.local_backend import worker_command
from poolgate.kernel.config import Config, ConfigError, parse_config
from simworker.cli import add_arguments, worker_specs


def config(task: str, backend: str = "sim", extra_args: tuple[str, ...] = ()) -> Config:
    worker: dict[str, Any] = {"id": "w", "pool": "p", "backend": backend, "extra_args": list(extra_args)}
    if backend == "vllm":
        worker["model_path"] = "BAAI/bge-m3"
    return Config.model_validate({"pools": [{"name": "p", "model": "bge-m3", "task": task}], "workers": [worker]})


@pytest.mark.parametrize(("task", "backend", "flags"), [
    ("embed", "vllm", ["--runner", "pooling", "--convert", "embed"]),
    ("score", "vllm", ["--runner", "pooling", "--convert", "classify"]),
    ("transcription", "vllm", []),
    ("generate", "vllm", []),
    ("embed", "sim", ["--runner", "pooling", "--convert", "embed"]),
    ("transcription", "sim", ["--transcription"]),
])
def test_workers_start_as_their_pool_kind(task: str, backend: str, flags: list[str]) -> None:
    cfg = config(task, backend)
    command, _ = worker_command(cfg, cfg.workers[0], 8001)
    for flag in ("--runner", "--convert", "--transcription"):
        assert (flag in command) == (flag in flags)
    if flags:
        start = command.index(flags[0])
        assert command[start:start + len(flags)] == flags


def test_extra_args_choose_the_kind_themselves() -> None:
    cfg = config("embed", "vllm", ("--runner", "pooling", "--convert", "classify"))
    command, _ = worker_command(cfg, cfg.workers[0], 8001)
    assert command.count("--runner") == 1 and command[command.index("--convert") + 1] == "classify"


@pytest.mark.parametrize(("task", "runner", "convert"), [("embed", "pooling", "embed"),
                                                         ("score", "pooling", "classify")])
def test_a_simulated_worker_takes_the_flags_it_is_given(task: str, runner: str, convert: str) -> None:
    cfg = config(task)
    command, _ = worker_command(cfg, cfg.workers[0], 8001)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    tasks = worker_specs(parser.parse_args(command[command.index("simworker") + 1:]))[0].tasks
    assert (tasks.runner, tasks.convert) == (runner, convert)


def test_pools_of_one_model_must_agree_on_its_task() -> None:
    text = """
pools:
  - {name: a, model: bge-m3, task: embed}
  - {name: b, model: bge-m3}
"""
    with pytest.raises(ConfigError, match=r"pools\.1\.task"):
        parse_config(yaml.safe_load(text))


def test_an_unknown_task_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"pools\.0\.task"):
        parse_config(yaml.safe_load("pools:\n  - {name: a, model: m, task: embedding}\n"))
