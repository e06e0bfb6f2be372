"""Run directories of the stacks the tests start (their config, logs and sockets): kept for reading when a test
of the session failed, removed with everything else when the whole session passed, so that a passing
``make test`` leaves nothing behind in the temporary directory (``tests/conftest.py`` does both at the end)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

_made: list[Path] = []


def run_directory(prefix: str) -> Path:
    """A new directory in the temporary directory (short: a unix socket path in it stays under ~100 bytes)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    _made.append(path)
    return path


def made() -> list[Path]:
    """The run directories of this session that still exist."""
    return [path for path in _made if path.exists()]


def remove_all() -> None:
    for path in _made:
        shutil.rmtree(path, ignore_errors=True)
    _made.clear()
