"""The peer routers' own virtual environment: ``vllm-router`` and ``sglang-router`` from PyPI, pinned.

They are not dependencies of poolgate: the benchmark installs them with pip into a virtualenv of its own
(by default under the user's cache folder, so a second run reuses it) and runs them from there. A marker
file records the pinned versions; a venv whose marker differs is installed again.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PINNED = {"vllm-router": "0.1.17", "sglang-router": "0.3.2"}
MARKER = "poolgate-bench-peers.txt"
INSTALL_TIMEOUT_S = 1200


def default_venv_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "poolgate" / "bench-peers"


@dataclass(frozen=True)
class PeerVenv:
    root: Path
    versions: dict[str, str]

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    @property
    def vllm_router(self) -> Path:
        return self.root / "bin" / "vllm-router"


def _marker_text() -> str:
    return "".join(f"{name}=={version}\n" for name, version in sorted(PINNED.items()))


def ensure_peers(root: Path, log: Path) -> PeerVenv:
    """The venv at ``root`` with the pinned peers, created or repaired with pip (output to ``log``)."""
    marker = root / MARKER
    venv = PeerVenv(root, dict(PINNED))
    if marker.is_file() and marker.read_text() == _marker_text() and venv.vllm_router.is_file():
        return venv
    root.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        steps = [[sys.executable, "-m", "venv", "--clear", str(root)],
                 [str(venv.python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                  *(f"{name}=={version}" for name, version in sorted(PINNED.items()))]]
        for command in steps:
            result = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    timeout=INSTALL_TIMEOUT_S, check=False)
            if result.returncode != 0:
                raise RuntimeError(f"installing the peer routers failed: {' '.join(command[:4])}… "
                                   f"exited {result.returncode} (log: {log})")
    marker.write_text(_marker_text())
    return venv
