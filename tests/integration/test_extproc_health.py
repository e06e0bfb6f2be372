"""extproc's grpc.health.v1 service, as a Kubernetes ``grpc`` probe or Envoy's gRPC health check asks it,
against ``poolgate extproc`` as a process (SIGTERM is what a pod gets on shutdown)."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from poolgate.procs import extproc_process, free_port

CONFIG = {"pools": [{"name": "chat", "model": "m"}], "key_prefix": "health-it"}
EXT_PROC = "envoy.service.ext_proc.v3.ExternalProcessor"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@contextmanager
def extproc(redis_url: str, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], health_pb2_grpc.HealthStub]]:
    config_file = tmp_path / "poolgate.yaml"
    config_file.write_text(yaml.safe_dump(CONFIG))
    with extproc_process(config_file, redis_url, log_level="ERROR") as (proc, port):
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        try:
            yield proc, health_pb2_grpc.HealthStub(channel)
        finally:
            channel.close()


def status(stub: health_pb2_grpc.HealthStub, service: str = "") -> int:
    return int(stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status)


def eventually(stub: health_pb2_grpc.HealthStub, wanted: int, service: str = "") -> None:
    deadline = time.monotonic() + 5
    while status(stub, service) != wanted:
        assert time.monotonic() < deadline, f"health of {service!r} never became {wanted}"
        time.sleep(0.02)


def test_serving_once_the_first_snapshot_is_read(redis_url: str, tmp_path: Path) -> None:
    with extproc(redis_url, tmp_path) as (_, stub):
        eventually(stub, SERVING)
        assert status(stub, EXT_PROC) == SERVING


def test_not_serving_without_a_snapshot(tmp_path: Path) -> None:
    """Redis unreachable from the start: extproc listens (Envoy's fail-open needs nothing from it) but asks
    for no traffic, since every pick would be a 503."""
    with extproc(f"redis://127.0.0.1:{free_port()}/0", tmp_path) as (_, stub):
        time.sleep(0.3)
        assert status(stub) == NOT_SERVING
        assert status(stub, EXT_PROC) == NOT_SERVING


def test_not_serving_while_shutting_down(redis_url: str, tmp_path: Path) -> None:
    with extproc(redis_url, tmp_path) as (proc, stub):
        eventually(stub, SERVING)
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert next(watch).status == SERVING
        proc.send_signal(signal.SIGTERM)  # streams get a grace period; probes must fail at once
        assert next(watch).status == NOT_SERVING
        watch.cancel()
        assert proc.wait(10) == 0
