"""How every poolgate process starts a child it owns (``up``'s programs, the controller's local workers).

In the child, before exec: a process group of its own, so the parent can signal the child and everything the
child started in one call (a real ``vllm serve`` leaves its engine core and workers running when only the API
server is killed), and SIGTERM when the parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``), so a parent killed
with SIGKILL, which can clean nothing up, leaves no child behind: a crashed controller's workers end with it
instead of running on outside every group its supervisor signals.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def own_group_dying_with_parent() -> None:
    """``preexec_fn`` of a child process (runs in the child between fork and exec)."""
    os.setsid()
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
