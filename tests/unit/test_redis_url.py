"""Redis URL forms: one server (redis-py's own), Sentinel and Cluster; a bad URL is refused naming what is
wrong, at configuration load and on the command line, without echoing its password."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from poolgate.kernel.config import Config, ConfigError
from poolgate.kernel.config.loader import load_process_config
from poolgate.kernel.redaction import redact_url
from poolgate.kernel.redis_client import parse_redis_url
from poolgate.kernel.store import connect
from poolgate.status import redis_url_argument


def test_single_server_urls_pass_through_unchanged() -> None:
    for url in ("redis://127.0.0.1:6379/0", "rediss://user:pw@redis.example:6380/2", "unix:///run/redis.sock"):
        target = parse_redis_url(url)
        assert (target.mode, target.url) == ("server", url)


def test_sentinel_url_names_sentinels_service_db_and_credentials() -> None:
    target = parse_redis_url("rediss+sentinel://app:s%3Acret@10.0.0.1:26379,[::1]:26380, s3:26381/mymaster/3"
                             "?sentinel_password=watch")
    assert target.mode == "sentinel" and target.tls
    assert target.nodes == (("10.0.0.1", 26379), ("::1", 26380), ("s3", 26381))
    assert (target.service, target.db) == ("mymaster", 3)
    assert (target.username, target.password, target.sentinel_password) == ("app", "s:cret", "watch")
    assert parse_redis_url("redis+sentinel://:pw@h:26379/svc").password == "pw"
    assert parse_redis_url("redis+sentinel://h:26379/svc").db == 0


def test_cluster_url_names_seed_nodes() -> None:
    target = parse_redis_url("redis+cluster://:pw@n1:7000,n2:7001")
    assert (target.mode, target.nodes, target.password, target.tls) == ("cluster", (("n1", 7000), ("n2", 7001)),
                                                                        "pw", False)
    assert parse_redis_url("rediss+cluster://n1:7000/0").tls


@pytest.mark.parametrize(("url", "says"), [
    ("redis+sentinel://h:26379", "service name"),
    ("redis+sentinel://h:26379/svc/x", "database must be a number"),
    ("redis+sentinel://h:26379/svc?timeout=1", "no query parameter timeout"),
    ("redis+sentinel:///svc", "at least one host:port"),
    ("redis+sentinel://h/svc", "host:port"),
    ("redis+cluster://n1:7000/1", "only database 0"),
    ("redis+cluster://n1:99999", "host:port"),
    ("sentinel://h:26379/svc", "unknown Redis URL scheme"),
    ("localhost:6379", "a Redis URL starts with"),
])
def test_bad_urls_are_refused_naming_the_problem(url: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_redis_url(url)


def test_refusals_never_echo_the_password() -> None:
    with pytest.raises(ValueError) as refused:
        parse_redis_url("redis+cluster://:hunter2@n1:7000/5")
    assert "hunter2" not in str(refused.value)
    assert "hunter2" not in redact_url("redis+sentinel://u:hunter2@h1:1,h2:2/svc")


def test_config_and_command_line_refuse_a_bad_url() -> None:
    with pytest.raises(ValueError, match="service name"):
        Config.model_validate({"redis_url": "redis+sentinel://h:26379"})
    with pytest.raises(argparse.ArgumentTypeError, match="only database 0"):
        redis_url_argument("redis+cluster://n:7000/2")
    with pytest.raises(ConfigError, match="--redis-url: unknown Redis URL scheme"):
        load_process_config(Path(__file__).parents[2] / "deploy" / "local.yaml", "http://h:1", "agent")


async def test_connect_builds_the_client_each_form_needs() -> None:
    """No server is contacted: the clients connect lazily."""
    single = connect("redis://127.0.0.1:1/0")
    sentinel = connect("redis+sentinel://127.0.0.1:1,127.0.0.1:2/svc/4", max_connections=None)
    cluster = connect("redis+cluster://127.0.0.1:1")
    try:
        assert isinstance(single, Redis) and isinstance(sentinel, Redis) and isinstance(cluster, RedisCluster)
        assert sentinel.connection_pool.connection_kwargs["db"] == 4
        assert [(s.connection_pool.connection_kwargs["host"], s.connection_pool.connection_kwargs["port"])
                for s in sentinel.sentinel_manager.sentinels] == [("127.0.0.1", 1), ("127.0.0.1", 2)]
    finally:
        for client in (single, sentinel, cluster):
            await client.aclose()


@pytest.mark.parametrize("url", ["redis://127.0.0.1:1/3?socket_timeout=2", "rediss://127.0.0.1:1/0",
                                 "unix:///tmp/poolgate-none.sock?db=5"])
async def test_a_single_server_client_packs_commands_in_c_into_the_bytes_redis_py_would_send(url: str) -> None:
    """Packing the registry's heartbeat pipelines in Python took a seventh of an API process's CPU at 10,000
    workers; the URL's own settings (TLS, socket, database, timeouts) are kept."""
    client = connect(url, max_connections=4)
    try:
        pool = client.connection_pool
        connection = pool.make_connection()
        plain = type(connection).__bases__[1](**pool.connection_kwargs)  # the redis-py class it stands in for
        assert type(connection).__name__.startswith("_Packed") and type(plain).__module__.startswith("redis.")
        heartbeat = ("EVALSHA", "f" * 40, 1, "{poolgate}:fleet:version", "{poolgate}", 1500, "0", 2, "updated_at",
                     1733239200.123456, "w00001", 0, "w00002", 2, "state", "Draining")
        for command in (heartbeat, ("SCRIPT LOAD", "return 1"), ("CONFIG GET", "maxmemory")):
            assert b"".join(connection.pack_command(*command)) == b"".join(plain.pack_command(*command))
        assert b"".join(connection.pack_commands([heartbeat, heartbeat])) == \
            b"".join(plain.pack_commands([heartbeat, heartbeat]))
        assert connection.db == pool.connection_kwargs["db"] == (3 if "/3" in url else 5 if "db=5" in url else 0)
    finally:
        await client.aclose()
