"""The config loader rejects bad files with the field path and a fix, and never defaults silently."""

from __future__ import annotations

from pathlib import Path

import pytest

from poolgate.cli import main as cli_main
from poolgate.kernel.config import ConfigError, load_config, parse_config

GOOD = {
    "pools": [{"name": "chat", "model": "m1"}, {"name": "code", "model": "m2", "max_model_len": 4096}],
    "workers": [{"id": "w1", "pool": "chat"}, {"id": "w2", "pool": "code", "preset": "l4-24gb"}],
}


def test_shipped_local_config_is_valid() -> None:
    config = load_config(Path(__file__).parents[2] / "deploy" / "local.yaml")
    assert {p.model for p in config.pools} and config.extproc.fail_open


def test_good_config_resolves_models_to_pools() -> None:
    config = parse_config(GOOD)
    assert [p.name for p in config.pools_for_model("m2")] == ["code"]
    assert config.pools_for_model("nope") == ()


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"pools": []}, "pools: Tuple should have at least 1 item"),
        ({"pools": [{"name": "Bad Name", "model": "m"}]}, "pools.0.name"),
        ({"pools": [{"name": "a", "model": "m", "max_model_len": 0}]}, "pools.0.max_model_len"),
        ({"workers": [{"id": "w", "pool": "missing"}]}, "workers.0.pool: unknown pool 'missing'"),
        ({"workers": [{"id": "w", "pool": "chat", "backend": "vllm"}]}, "needs model_path"),
        ({"workers": [{"id": "w", "pool": "chat", "backend": "tgi"}]}, "workers.0.backend"),
        ({"workers": [{"id": "w", "pool": "chat"}, {"id": "w", "pool": "chat"}]}, "worker ids must be unique"),
        ({"ports": {"envoy": 70000}}, "ports.envoy"),
        ({"controller": {"heartbeat_interval_s": 2, "heartbeat_ttl_s": 1}}, "at least twice"),
        ({"colour": "blue"}, "colour: Extra inputs are not permitted"),
        ({"tls": {"xds": {"cert_file": "s.pem", "key_file": "k.pem"}}}, "tls: envoy: xds or extproc serve TLS"),
        ({"tls": {"extproc": {"cert_file": "s.pem", "key_file": "k.pem", "client_ca_file": "ca.pem"},
                  "envoy": {"ca_file": "ca.pem"}}}, "tls.envoy needs cert_file and key_file"),
        ({"tls": {"workers": {"ca_file": "ca.pem", "cert_file": "c.pem"}}}, "tls.workers: cert_file and key_file go"),
        ({"tls": {"registry_api": {"cert_file": "", "key_file": "k.pem"}}}, "tls.registry_api.cert_file"),
        ({"tls": {"reload_s": 0}}, "tls.reload_s"),
        ({"tls": {"workers": {"ca_file": "ca.pem"}}}, "tls: envoy_sds_dir: Envoy reads its certificate files"),
        ({"tls": {"workers": {"ca_file": "ca.pem"}, "envoy_sds_dir": "sds"}}, "envoy_sds_dir: 'sds' is relative"),
        ({"tls": {"local_workers": {"cert_file": "s.pem", "key_file": "k.pem"}}},
         "tls: local_workers: the local backend's workers serve HTTPS, so tls.workers"),
        ({"tls": {"local_workers": {"cert_file": "s.pem", "key_file": "k.pem", "client_ca_file": "ca.pem"},
                  "workers": {"ca_file": "ca.pem"}, "envoy_sds_dir": "/sds"}}, "tls.workers needs cert_file"),
        ({"tls": {"workers": {"ca_file": "ca.pem"}, "envoy_sds_dir": "/sds"}},
         "workers.0: tls.workers has Envoy and the probes reach workers over HTTPS"),
    ],
)
def test_bad_values_name_their_field(change: dict[str, object], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({**GOOD, **change}, "test.yaml")
    assert expected in str(info.value)


def test_config_check_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("pools:\n  - name: a\n    model: x\nworkers:\n  - {id: w, pool: b}\n")
    assert cli_main(["config", "check", str(bad)]) == 2
    assert "workers.0.pool" in capsys.readouterr().err
    broken = tmp_path / "broken.yaml"
    broken.write_text("pools: [\n")
    assert cli_main(["config", "check", str(broken)]) == 2
    assert "not valid YAML" in capsys.readouterr().err
