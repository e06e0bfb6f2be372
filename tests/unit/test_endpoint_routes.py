"""Every Envoy route poolgate ships sends every path routed by model through extproc and the pool it chose:
``/tokenize`` and the other vLLM paths outside ``/v1/`` included, and nothing else outside ``/v1/``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from controller.xds.bootstrap import render_bootstrap
from extproc.endpoints import ENDPOINTS
from poolgate.kernel.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def _yaml(*parts: str) -> Any:
    return yaml.safe_load(ROOT.joinpath(*parts).read_text())


def _matches(match: dict[str, Any], path: str) -> bool:
    """Envoy's route path match (``safe_regex`` is RE2, matched against the whole path)."""
    if "prefix" in match:
        return path.startswith(match["prefix"])
    if "safe_regex" in match:
        return re.fullmatch(match["safe_regex"]["regex"], path) is not None
    if "path" in match:
        return path == match["path"]
    raise AssertionError(f"unexpected route match {match}")


def _k8s_routes() -> list[dict[str, Any]]:
    listener = _yaml("deploy", "kubernetes", "envoy-bootstrap.yaml")["static_resources"]["listeners"][0]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return manager["route_config"]["virtual_hosts"][0]["routes"]  # type: ignore[no-any-return]


def _bootstrap_routes() -> list[dict[str, Any]]:
    rendered = render_bootstrap(load_config(ROOT / "deploy" / "local.yaml"), node_id="n1", listen_port=8080,
                                admin_port=9901, extproc_port=9002, xds_port=18000)
    listener = rendered["static_resources"]["listeners"][0]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return manager["route_config"]["virtual_hosts"][0]["routes"]  # type: ignore[no-any-return]


def _istio_route() -> list[dict[str, Any]]:
    patches = _yaml("deploy", "istio", "envoyfilter.yaml")["spec"]["configPatches"]
    return [p["patch"]["value"] for p in patches if p["applyTo"] == "HTTP_ROUTE"]


ROUTE_SETS = {
    "poolgate up": _bootstrap_routes,
    "snippet": lambda: _yaml("envoy", "snippet", "poolgate.yaml")["routes"],
    "pinned snippet": lambda: _yaml("envoy", "snippet", "pinned-cluster.yaml")["routes"],
    "kubernetes": _k8s_routes,
    "istio": _istio_route,
}


@pytest.mark.parametrize("where", sorted(ROUTE_SETS))
@pytest.mark.parametrize("path", sorted(ENDPOINTS))
def test_every_routed_path_takes_every_poolgate_route(where: str, path: str) -> None:
    routes = ROUTE_SETS[where]()
    assert routes and all(_matches(route["match"], path) for route in routes)


@pytest.mark.parametrize("where", ["snippet", "pinned snippet", "kubernetes", "istio"])
def test_the_users_other_paths_stay_theirs(where: str) -> None:
    for route in ROUTE_SETS[where]():
        assert not any(_matches(route["match"], path) for path in ("/healthz", "/", "/v2/other", "/tokenizer"))


def test_the_istio_virtual_service_serves_them_when_extproc_is_away() -> None:
    documents = list(yaml.safe_load_all(ROOT.joinpath("deploy", "istio", "gateway.yaml").read_text()))
    [service] = [d for d in documents if d["kind"] == "VirtualService"]
    uris = [m["uri"] for m in service["spec"]["http"][0]["match"]]
    for path in ENDPOINTS:
        assert any(path.startswith(u["prefix"]) if "prefix" in u else re.fullmatch(u["regex"], path) for u in uris)
