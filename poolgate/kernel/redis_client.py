"""Which Redis deployment a URL names, and the asyncio client every poolgate process opens on it.

- ``redis://``, ``rediss://``, ``unix://``: one server (redis-py's own URL forms, unchanged).
- ``redis+sentinel://[user:password@]host:port[,host:port…]/service[/db]`` (``rediss+sentinel://``: TLS to
  the data nodes): the sentinels to ask for the master of ``service``; the client follows the master they
  name, also after a failover. ``?sentinel_password=…`` (and ``sentinel_username``) when the sentinels
  want their own credentials; the userinfo is for the master.
- ``redis+cluster://[user:password@]host:port[,host:port…]`` (``rediss+cluster://``): some nodes of a Redis
  Cluster (the client learns the others); a cluster has only database 0.

``open_client`` is the one place a client is built (``poolgate.kernel.store.connect`` calls it): the
controller, extproc, the agent and the operator commands all reach every deployment the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, TypeAlias
from urllib.parse import parse_qsl, unquote, urlsplit

import hiredis
from redis.asyncio import BlockingConnectionPool, ConnectionPool, Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import (
    AbstractConnection,
    Connection,
    SSLConnection,
    UnixDomainSocketConnection,
    parse_url,
)
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import ExponentialBackoff

RedisLike: TypeAlias = Redis | RedisCluster
"""The async client a poolgate process holds: one server's or Sentinel's master (``Redis``), or a cluster."""

Mode = Literal["server", "sentinel", "cluster"]

_SCHEMES: dict[str, tuple[Mode, bool]] = {
    "redis+sentinel": ("sentinel", False), "rediss+sentinel": ("sentinel", True),
    "redis+cluster": ("cluster", False), "rediss+cluster": ("cluster", True),
}
_SENTINEL_QUERY = frozenset({"sentinel_password", "sentinel_username"})


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """A parsed Redis URL. ``nodes`` are the sentinels (Sentinel) or the seed nodes (Cluster); a single
    server keeps its ``url`` for redis-py to parse."""

    mode: Mode
    url: str
    nodes: tuple[tuple[str, int], ...] = ()
    service: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False
    sentinel_username: str | None = None
    sentinel_password: str | None = None


def parse_redis_url(url: str) -> RedisTarget:
    """The deployment ``url`` names; ValueError saying what is wrong (never echoing a password)."""
    scheme, sep, _ = url.partition("://")
    if not sep:
        raise ValueError("a Redis URL starts with redis://, rediss://, unix://, redis+sentinel:// or redis+cluster://")
    if scheme not in _SCHEMES:
        if scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"unknown Redis URL scheme {scheme!r}: use redis://, rediss://, unix://, "
                             "redis+sentinel:// or redis+cluster://")
        return RedisTarget("server", url)
    mode, tls = _SCHEMES[scheme]
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    username = password = None
    if at:
        user, has_password, secret = userinfo.partition(":")
        username, password = (unquote(user) or None, unquote(secret)) if has_password else (None, unquote(user))
    nodes = tuple(_host_port(part, scheme) for part in hosts.split(",") if part.strip())
    if not nodes:
        raise ValueError(f"{scheme}:// needs at least one host:port")
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    allowed = _SENTINEL_QUERY if mode == "sentinel" else frozenset()
    unknown = sorted(set(query) - allowed)
    if unknown:
        raise ValueError(f"{scheme}:// takes no query parameter {', '.join(unknown)}"
                         + (f" (known: {', '.join(sorted(allowed))})" if allowed else ""))
    path = [unquote(p) for p in parts.path.split("/") if p]
    if mode == "cluster":
        if path not in ([], ["0"]):
            raise ValueError("redis+cluster:// takes no path: a Redis Cluster has only database 0")
        return RedisTarget(mode, url, nodes, username=username, password=password, tls=tls)
    if not path or len(path) > 2:
        raise ValueError("redis+sentinel:// needs the master's service name as its path: /service[/db]")
    db = path[1] if len(path) == 2 else "0"
    if not db.isdigit():
        raise ValueError(f"redis+sentinel:// database must be a number, not {db!r}")
    return RedisTarget(mode, url, nodes, path[0], int(db), username, password, tls,
                       query.get("sentinel_username") or None, query.get("sentinel_password") or None)


def _host_port(part: str, scheme: str) -> tuple[str, int]:
    part = part.strip()
    if part.startswith("["):
        host, _, rest = part[1:].partition("]")
        port = rest.removeprefix(":")
    else:
        host, _, port = part.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{scheme}:// hosts are host:port, comma-separated (got {part!r})")
    return host, int(port)


class _HiredisPacking(AbstractConnection):
    """Commands packed by hiredis (C) instead of redis-py's packer (Python; its asyncio connections do not use
    hiredis for this): the same bytes, 8 times faster. At 10,000 workers packing the registry's heartbeat
    pipelines took a seventh of an API process's CPU."""

    def pack_command(self, *args: Any) -> list[bytes]:
        if isinstance(args[0], str) and " " in args[0]:  # as redis-py does: "SCRIPT LOAD" is two words
            args = (*args[0].split(), *args[1:])
        return [hiredis.pack_command(args)]


class _PackedConnection(_HiredisPacking, Connection):
    pass


class _PackedSSLConnection(_HiredisPacking, SSLConnection):
    pass


class _PackedUnixConnection(_HiredisPacking, UnixDomainSocketConnection):
    pass


_PACKED: dict[type[AbstractConnection], type[AbstractConnection]] = {
    Connection: _PackedConnection, SSLConnection: _PackedSSLConnection,
    UnixDomainSocketConnection: _PackedUnixConnection}
"""The connection class redis-py picks for a server URL → its twin packed by hiredis (Sentinel's and Cluster's
connections keep redis-py's packer)."""


class _BlockingSentinelPool(SentinelConnectionPool, BlockingConnectionPool):
    """Sentinel's master pool that, like the single-server pool, queues a burst for a free connection."""


class _SentinelMaster(Redis):
    """The master's client; closing it also closes the connections to the sentinels."""

    sentinel_manager: Sentinel | None = None

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        for client in self.sentinel_manager.sentinels if self.sentinel_manager is not None else ():
            await client.aclose()


CLUSTER_CONNECTIONS = 1000
"""Connections per node a Cluster client opens at most when no limit is asked for."""


def open_client(url: str, *, max_connections: int | None, wait_s: float, socket_timeout: float | None = None,
                socket_connect_timeout: float | None = None, retries: int | None = None) -> RedisLike:
    """A client for the deployment ``url`` names. ``retries`` (with a short backoff) replaces redis-py's
    default retry policy. Callers past ``max_connections`` wait up to ``wait_s`` (one server, Sentinel) or
    fail at once (Cluster: the limit is per node); None opens as many as callers need."""
    target = parse_redis_url(url)
    options: dict[str, Any] = {"socket_timeout": socket_timeout, "socket_connect_timeout": socket_connect_timeout}
    if retries is not None:
        options["retry"] = Retry(ExponentialBackoff(cap=0.2, base=0.02), retries)
    pooled: dict[str, Any] = {} if max_connections is None else {"max_connections": max_connections,
                                                                 "timeout": wait_s}
    if target.mode == "server":
        pool_class = ConnectionPool if max_connections is None else BlockingConnectionPool
        url_options = parse_url(url)  # what from_url does, with the connection class swapped for its packed twin
        url_options["connection_class"] = _PACKED[url_options.get("connection_class", Connection)]
        return Redis.from_pool(pool_class(**{**pooled, **options, **url_options}))
    auth: dict[str, Any] = {"username": target.username, "password": target.password}
    if target.mode == "cluster":
        return RedisCluster(startup_nodes=[ClusterNode(host, port) for host, port in target.nodes],
                            max_connections=max_connections or CLUSTER_CONNECTIONS, ssl=target.tls, **auth,
                            **options)
    sentinel = Sentinel(list(target.nodes), sentinel_kwargs={
        "username": target.sentinel_username, "password": target.sentinel_password,
        "socket_timeout": socket_timeout, "socket_connect_timeout": socket_connect_timeout})
    sentinel_pool = SentinelConnectionPool if max_connections is None else _BlockingSentinelPool
    client = sentinel.master_for(target.service, redis_class=_SentinelMaster, connection_pool_class=sentinel_pool,
                                 db=target.db, ssl=target.tls, **pooled, **auth, **options)
    client.sentinel_manager = sentinel
    return client
