"""The Kubernetes manifests agree with the backend: names, labels, RBAC verbs, a valid poolgate config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from controller.kube_backend import POOL_LABEL, PORT_ANNOTATION
from poolgate.kernel.config import parse_config

K8S = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"


def docs() -> list[dict[str, Any]]:
    """The kustomization's resources plus the ConfigMaps its generator makes from files."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    generated = [{"kind": "ConfigMap", "metadata": {"name": g["name"]},
                  "data": {name: (K8S / name).read_text() for name in g["files"]}}
                 for g in kustomization["configMapGenerator"]]
    return [d for name in kustomization["resources"] for d in yaml.safe_load_all((K8S / name).read_text()) if d] + [
        d for d in generated if "poolgate.yaml" in d["data"]]


def test_embedded_config_is_valid_and_names_the_worker_deployments() -> None:
    [config_map] = [d for d in docs() if d["kind"] == "ConfigMap"]
    config = parse_config(yaml.safe_load(config_map["data"]["poolgate.yaml"]))
    assert config.kubernetes.enabled
    deployments = {d["metadata"]["name"]: d for d in docs() if d["kind"] == "Deployment"}
    for pool in config.pools:
        worker = deployments[f"{config.kubernetes.deployment_prefix}{pool.name}"]
        template = worker["spec"]["template"]
        assert template["metadata"]["labels"][POOL_LABEL] == pool.name
        assert PORT_ANNOTATION in template["metadata"]["annotations"]
        assert template["spec"]["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/health"


def test_rbac_grants_what_the_backend_calls() -> None:
    [role] = [d for d in docs() if d["kind"] == "Role"]
    grants = {(group, resource): set(rule["verbs"])
              for rule in role["rules"] for group in rule["apiGroups"] for resource in rule["resources"]}
    assert grants[("apps", "deployments/scale")] >= {"get", "patch"}
    assert grants[("", "pods")] >= {"list", "patch", "delete"}
