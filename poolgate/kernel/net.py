"""Local ports: picking a free one, for a process that starts a listener of its own (a worker, a test
server), and waiting until something listens on one."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections import deque

_HANDED_OUT_KEPT = 4096
_handed_out: deque[int] = deque(maxlen=_HANDED_OUT_KEPT)
_handed_out_lock = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago, and never one this process was handed recently.

    The OS may give the same free port to two binds in a row once the first socket is closed; two listeners
    chosen that way would collide (Envoy refuses a duplicate listener address, and servers that listen with
    ``SO_REUSEPORT`` would silently share it). Another process may still take the port before its user binds
    it: that race is left, as with any such helper."""
    with _handed_out_lock:
        while True:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((host, 0))
                port = int(sock.getsockname()[1])
            if port not in _handed_out:
                _handed_out.append(port)
                return port


async def wait_port(host: str, port: int, timeout_s: float) -> bool:
    """Whether something accepts connections on ``host:port`` within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            _, writer = await asyncio.open_connection(host, port)
            writer.close()
            return True
        except OSError:
            await asyncio.sleep(0.05)
    return False
