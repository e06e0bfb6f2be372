"""deploy/kubernetes: every manifest loads into the official client's models with no unknown field, the
kustomization lists every file, and the pieces agree with each other and with the poolgate config."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client as k8s

from agent.cli import NODE_ENV
from agent.podresources import POD_RESOURCES_SOCKET
from controller.kube_backend import POOL_LABEL, PORT_ANNOTATION
from poolgate.kernel.config import Config, parse_config

KUBE = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
KUSTOMIZATION = yaml.safe_load((KUBE / "kustomization.yaml").read_text())
PRIMITIVES: dict[str, tuple[type, ...]] = {"str": (str,), "int": (int,), "bool": (bool,),
                                           "float": (int, float), "object": (object,), "datetime": (str,),
                                           "bytes": (str,)}
"""Int-or-string fields (ports) are ``object`` in the client's models; quantities must be strings there."""


def manifests() -> list[tuple[str, dict[str, Any]]]:
    return [(name, doc) for name in KUSTOMIZATION["resources"]
            for doc in yaml.safe_load_all((KUBE / name).read_text()) if doc]


def generated_files() -> dict[str, str]:
    """configMapGenerator name → the one file it packs."""
    return {g["name"]: g["files"][0] for g in KUSTOMIZATION["configMapGenerator"]}


def model_class(resource: dict[str, Any]) -> str:
    version = resource["apiVersion"].split("/")[-1]
    return f"{version.capitalize()}{resource['kind']}"


def strict_problems(value: Any, type_name: str, where: str) -> list[str]:
    """Every key must be a field of the model (the client's own deserializer drops unknown keys silently)."""
    if type_name.startswith(("list[", "List[")):
        if not isinstance(value, list):
            return [f"{where}: expected a list"]
        inner = type_name[5:-1]
        return [p for i, item in enumerate(value) for p in strict_problems(item, inner, f"{where}[{i}]")]
    mapping = re.fullmatch(r"(?:dict\(str, (.+)\)|Dict\[str, (.+)\])", type_name)
    if mapping:
        if not isinstance(value, dict):
            return [f"{where}: expected a mapping"]
        inner_type = mapping.group(1) or mapping.group(2)
        return [p for key, item in value.items() for p in strict_problems(item, inner_type, f"{where}.{key}")]
    if type_name in PRIMITIVES:
        return [] if isinstance(value, PRIMITIVES[type_name]) else [f"{where}: expected {type_name}"]
    model = getattr(k8s, type_name)
    if not isinstance(value, dict):
        return [f"{where}: expected a {type_name} mapping"]
    by_json_name = {json_name: attr for attr, json_name in model.attribute_map.items()}
    problems = []
    for key, item in value.items():
        if key not in by_json_name:
            problems.append(f"{where}.{key}: not a field of {type_name}")
        else:
            problems.extend(strict_problems(item, model.openapi_types[by_json_name[key]], f"{where}.{key}"))
    return problems


@pytest.mark.parametrize(("source", "resource"), manifests(),
                         ids=lambda v: v if isinstance(v, str) else f"{v['kind']}/{v['metadata']['name']}")
def test_manifest_loads_into_the_client_models(source: str, resource: dict[str, Any]) -> None:
    type_name = model_class(resource)
    assert strict_problems(resource, type_name, f"{source}:{resource['kind']}") == []
    api = k8s.ApiClient()
    loaded = api._ApiClient__deserialize(resource, type_name)  # type: ignore[attr-defined]  # required fields
    assert loaded.metadata.name == resource["metadata"]["name"]


def test_strict_check_catches_a_typo() -> None:
    [(_, deployment)] = [(s, r) for s, r in manifests() if r["metadata"]["name"] == "poolgate-extproc"
                         and r["kind"] == "Deployment"]
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    assert strict_problems(broken, "V1Deployment", "x") == [
        "x.spec.template.spec.containers[0].readinesProbe: not a field of V1Container"]


def test_kustomization_lists_every_file() -> None:
    listed = {*KUSTOMIZATION["resources"], *generated_files().values(), "kustomization.yaml"}
    assert {p.name for p in KUBE.glob("*.yaml")} == listed


def config() -> Config:
    return parse_config(yaml.safe_load((KUBE / generated_files()["poolgate-config"]).read_text()))


def _objects(kind: str) -> dict[str, dict[str, Any]]:
    return {r["metadata"]["name"]: r for _, r in manifests() if r["kind"] == kind}


def _container(name: str, kind: str = "Deployment") -> dict[str, Any]:
    container: dict[str, Any] = _objects(kind)[name]["spec"]["template"]["spec"]["containers"][0]
    return container


def test_one_worker_deployment_per_pool_with_gpu_and_probes() -> None:
    settings = config()
    deployments = _objects("Deployment")
    for pool in settings.pools:
        worker = deployments[f"{settings.kubernetes.deployment_prefix}{pool.name}"]
        template = worker["spec"]["template"]
        assert template["metadata"]["labels"][POOL_LABEL] == pool.name
        assert worker["spec"]["selector"]["matchLabels"][POOL_LABEL] == pool.name
        container = template["spec"]["containers"][0]
        args = container["args"]
        assert args[args.index("--served-model-name") + 1] == pool.model
        assert int(args[args.index("--max-model-len") + 1]) == pool.max_model_len
        assert args[args.index("--port") + 1] == template["metadata"]["annotations"][PORT_ANNOTATION]
        assert "--disable-log-stats" not in args  # the agent reads the engine's /metrics
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"]["path"] == "/health"
        assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1


def test_processes_read_the_generated_config_and_listen_where_it_says() -> None:
    settings = config()
    for kind, name in (("Deployment", "poolgate-controller"), ("Deployment", "poolgate-extproc"),
                       ("DaemonSet", "poolgate-agent")):
        spec = _objects(kind)[name]["spec"]["template"]["spec"]
        assert {"name": "config", "configMap": {"name": "poolgate-config"}} in spec["volumes"]
        assert "/etc/poolgate/poolgate.yaml" in spec["containers"][0]["args"]
    extproc = _container("poolgate-extproc")
    assert int(extproc["args"][extproc["args"].index("--port") + 1]) == settings.ports.extproc
    assert _objects("Deployment")["poolgate-extproc"]["spec"]["replicas"] >= 2
    controller_ports = {p["name"]: p["containerPort"] for p in _container("poolgate-controller")["ports"]}
    assert (controller_ports["xds"], controller_ports["api"]) == (settings.ports.xds, settings.ports.controller_http)
    assert settings.redis_url == "redis://poolgate-redis:6379/0" and "poolgate-redis" in _objects("Service")
    assert settings.kubernetes.namespace == KUSTOMIZATION["namespace"]


def test_agent_knows_its_node_and_reads_the_kubelets_pod_resources() -> None:
    agent = _container("poolgate-agent", "DaemonSet")
    env = {e["name"]: e for e in agent["env"]}
    assert env[NODE_ENV]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    spec = _objects("DaemonSet")["poolgate-agent"]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    socket_dir = POD_RESOURCES_SOCKET.rsplit("/", 1)[0]
    [mount] = [m for m in agent["volumeMounts"] if m["mountPath"] == socket_dir]
    assert mount["readOnly"] is True
    assert volumes[mount["name"]]["hostPath"]["path"] == socket_dir


def test_envoy_reaches_extproc_and_the_controller_through_services() -> None:
    bootstrap = yaml.safe_load((KUBE / generated_files()["poolgate-envoy"]).read_text())
    services = _objects("Service")
    for cluster in bootstrap["static_resources"]["clusters"]:
        address = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"][
            "socket_address"]
        name, namespace = address["address"].split(".")[:2]
        assert namespace == KUSTOMIZATION["namespace"]
        assert address["port_value"] in {p["port"] for p in services[name]["spec"]["ports"]}
    assert services["poolgate-extproc-headless"]["spec"]["clusterIP"] == "None"  # one address per replica


def test_rbac_grants_what_the_backend_calls() -> None:
    [role] = _objects("Role").values()
    grants = {(group, resource): set(rule["verbs"])
              for rule in role["rules"] for group in rule["apiGroups"] for resource in rule["resources"]}
    assert grants[("apps", "deployments/scale")] >= {"get", "patch"}
    assert grants[("", "pods")] >= {"list", "patch", "delete"}
    spec = _objects("Deployment")["poolgate-controller"]["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == role["metadata"]["name"]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kustomize_builds() -> None:
    built = subprocess.run(["kubectl", "kustomize", str(KUBE)], capture_output=True, text=True, timeout=60)
    assert built.returncode == 0, built.stderr
    kinds = [doc["kind"] for doc in yaml.safe_load_all(built.stdout) if doc]
    assert kinds.count("ConfigMap") == 2 and "DaemonSet" in kinds
