"""A stop signal ends every poolgate process within its deadline, even when the graceful stop hangs; a hang
leaves the stacks of all threads in the log, so it can be fixed."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import yaml

from poolgate.procs import extproc_process

CHILD = textwrap.dedent("""
    import asyncio, sys
    from poolgate.kernel.shutdown import on_stop_signal

    async def main(hang: bool) -> None:
        stop = asyncio.Event()
        on_stop_signal(asyncio.get_running_loop(), stop.set, deadline_s=0.5)
        print("ready", flush=True)
        await stop.wait()
        while hang:  # a stop that never finishes, like a server stop waiting on a lost stream
            await asyncio.sleep(60)

    asyncio.run(main(sys.argv[1] == "hang"))
""")


def run_until_signalled(mode: str) -> tuple[int, str, float]:
    child = subprocess.Popen([sys.executable, "-c", CHILD, mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        started = time.monotonic()
        child.send_signal(signal.SIGTERM)
        if mode == "hang":  # a second signal must not postpone the deadline (a stopped loop may not catch it)
            time.sleep(0.2)
            child.send_signal(signal.SIGTERM)
        _, stderr = child.communicate(timeout=30)
        return child.returncode, stderr, time.monotonic() - started
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()


def test_a_hung_stop_is_cut_at_the_deadline_with_every_stack_logged() -> None:
    code, stderr, took = run_until_signalled("hang")
    print(f"hung stop ended {took:.2f} s after SIGTERM (deadline 0.5 s)")
    assert code == 1
    assert "exiting within 0.5 s" in stderr
    assert "Timeout" in stderr and "most recent call first" in stderr, stderr


def test_a_clean_stop_exits_normally_without_a_stack_dump() -> None:
    code, stderr, _ = run_until_signalled("clean")
    assert code == 0
    assert "most recent call first" not in stderr


def test_extproc_exits_cleanly_on_sigterm(redis_url: str, tmp_path: Path) -> None:
    config = tmp_path / "poolgate.yaml"
    config.write_text(yaml.safe_dump({"pools": [{"name": "chat", "model": "m"}], "key_prefix": "stop-it"}))
    with extproc_process(config, redis_url) as (process, _):
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
