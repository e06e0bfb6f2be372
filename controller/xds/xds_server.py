"""``XdsServer``: the ADS protocol server and the fleet snapshots it serves, wired over one cache.

``FleetSnapshots`` builds, checks and publishes (``snapshots``); ``AdsServer`` speaks the protocol
(``server``); they share nothing but the ``SnapshotCache`` and the publish → notify call. ``update`` may be
called as often as the fleet changes; the first call (the caller's first full read of the fleet) opens the
service to every waiting stream.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence

from controller.xds.cache import Snapshot, SnapshotCache
from controller.xds.server import AdsServer, GrpcService, StreamStatus
from controller.xds.snapshots import Fleet, FleetSnapshots
from poolgate.kernel.config import PoolSpec, TlsServerFiles, TlsSettings


class XdsServer:
    """ADS for the pools of one config."""

    def __init__(self, pools: tuple[PoolSpec, ...], tls: TlsSettings | None = None, *,
                 fallback_period_s: float | None = None, fallback_quiet_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._cache = SnapshotCache()
        self._ads = AdsServer(self._cache)
        self._snapshots = FleetSnapshots(pools, self._cache, self._ads.notify, tls,
                                         fallback_period_s=fallback_period_s, fallback_quiet_s=fallback_quiet_s,
                                         clock=clock)

    async def start(self, host: str = "127.0.0.1", port: int = 0, tls: TlsServerFiles | None = None,
                    services: Sequence[GrpcService] = ()) -> int:
        """Bind and serve ADS (see ``AdsServer.start``); returns the bound port."""
        return await self._ads.start(host, port, tls, services)

    def update(self, workers: Fleet, changed: Collection[str] | None = None) -> str:
        """Rebuild the clusters whose endpoints changed, publish, push; returns the snapshot version (see
        ``FleetSnapshots.update``). Call it from the event loop the server runs on."""
        return self._snapshots.update(workers, changed)

    async def update_off_loop(self, workers: Fleet, changed: Collection[str] | None = None) -> str:
        """``update`` with the build in a worker thread."""
        return await self._snapshots.update_off_loop(workers, changed)

    def worker_at(self, host: str, port: int) -> str | None:
        """The worker Envoy was sent at ``host:port`` (any thread: a dict read)."""
        return self._snapshots.worker_at(host, port)

    @property
    def fallback_due(self) -> bool:
        return self._snapshots.fallback_due

    @property
    def assignments_built(self) -> int:
        """Cluster load assignments built so far (a one-worker change builds one)."""
        return self._snapshots.assignments_built

    @property
    def snapshots_refused(self) -> int:
        """Snapshots not published because they did not hold together (each logged as an error)."""
        return self._snapshots.refused

    @property
    def version(self) -> str:
        return self._cache.version()

    def streams(self) -> list[StreamStatus]:
        return self._ads.streams()

    def _publish(self, snapshots: Sequence[Snapshot]) -> str:
        """Publish ``snapshots`` as they are, once checked (tests: a snapshot Envoy will reject, or one the
        check refuses)."""
        return self._snapshots._publish(snapshots)

    async def stop(self, grace: float = 1.0) -> None:
        self._snapshots.stop()
        await self._ads.stop(grace)
