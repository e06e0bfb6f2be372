"""Live configuration reload: notice that the config file changed and hand over the new, validated config.

Polling the file's modification time and size (no inotify: it works the same on every filesystem and in a
container with a mounted ConfigMap, whose update replaces a symlink). A new file that does not validate is
logged with every error and ignored; the process keeps the configuration it has. What a process does with a
new configuration is its own business: extproc swaps its model catalogue; parts that need a restart (pools,
ports, tenants) are only reported.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

from poolgate.kernel.config import Config, ConfigError, load_config

log = logging.getLogger(__name__)

Stamp = tuple[int, int] | None


def _stamp(path: Path) -> Stamp:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_mtime_ns, info.st_size


class ConfigFileWatch:
    """``check`` returns the new Config once per change of the file (None when unchanged or invalid)."""

    def __init__(self, path: str | Path, current: Config, stamp: Callable[[Path], Stamp] = _stamp) -> None:
        self.path = Path(path)
        self.current = current
        self._stamp = stamp
        self._seen = stamp(self.path)
        self.rejected = 0
        """Changed files that did not validate (kept the previous configuration)."""

    def check(self) -> Config | None:
        stamp = self._stamp(self.path)
        if stamp is None or stamp == self._seen:
            return None
        self._seen = stamp
        try:
            config = load_config(self.path)
        except ConfigError as exc:
            self.rejected += 1
            log.error("configuration change ignored, keeping the previous one: %s", exc)
            return None
        previous, self.current = self.current, config
        if previous.pools != config.pools or previous.tenants != config.tenants or previous.ports != config.ports:
            log.warning("configuration reloaded; changes to pools, tenants or ports need a restart to apply")
        return config

    async def run(self, interval_s: float, on_change: Callable[[Config], None],
                  sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        while True:
            await sleep(interval_s)
            config = self.check()
            if config is not None:
                on_change(config)
