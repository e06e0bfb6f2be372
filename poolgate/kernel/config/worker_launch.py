"""Checks of a launched worker's settings that a real engine showed were needed: its device and its KV events.

A ``vllm`` worker runs on GPUs unless it has ``kv_cache_gib``: the CPU build of vLLM sizes its KV cache from
``VLLM_CPU_KVCACHE_SPACE`` (GiB) and reads ``--gpu-memory-utilization`` as a share of the machine's RAM, so a
CPU worker given GPU settings is a mistake worth stopping at load.

vLLM's KV-event publisher (``--kv-events-config``) binds its PUB socket only when the ``endpoint`` contains
``*`` or ``::`` or is ``ipc://`` / ``inproc://``; any other ``tcp://HOST:P`` it *connects* to. Subscribers
connect too, so no event ever arrives and nothing reports an error. Its replay socket always binds. Port 0
(``tcp://*:0``) makes vLLM pick a port it reports only on ``GET /kv_event_sources``.
"""

from __future__ import annotations

import orjson

KV_EVENTS_FLAG = "--kv-events-config"


def check_cpu_worker(backend: object, gpus: object) -> None:
    """ValueError when a CPU worker (one with ``kv_cache_gib``) is not a ``vllm`` worker or names GPUs."""
    if backend != "vllm":
        raise ValueError("kv_cache_gib sizes a real vLLM engine's KV cache on CPU: it needs backend 'vllm' "
                         "(a simulated worker's KV cache follows its preset)")
    if gpus:
        raise ValueError("kv_cache_gib makes this a CPU worker, which runs on no GPU: remove gpus (or remove "
                         "kv_cache_gib to run it on GPUs)")


def kv_events_config(extra_args: tuple[str, ...]) -> tuple[bool, dict[str, object] | None]:
    """Whether ``extra_args`` carry ``--kv-events-config``, and its JSON object when it parses as one."""
    for index, arg in enumerate(extra_args):
        text = None
        if arg == KV_EVENTS_FLAG and index + 1 < len(extra_args):
            text = extra_args[index + 1]
        elif arg.startswith(KV_EVENTS_FLAG + "="):
            text = arg.split("=", 1)[1]
        if text is not None:
            try:
                parsed = orjson.loads(text)
            except orjson.JSONDecodeError:
                return True, None
            return True, parsed if isinstance(parsed, dict) else None
    return False, None


def publisher_binds(endpoint: str) -> bool:
    """vLLM's rule for its PUB socket: bind for a wildcard, an IPv6 address, ``ipc://`` or ``inproc://``."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def check_kv_events_args(extra_args: tuple[str, ...]) -> None:
    """ValueError when ``extra_args`` give vLLM a KV-event ``endpoint`` it would connect to instead of binding."""
    _, config = kv_events_config(extra_args)
    if not config or not config.get("enable_kv_cache_events"):
        return
    for field in ("endpoint", "replay_endpoint"):
        value = config.get(field)
        if isinstance(value, str) and value.startswith("tcp://") and value.rpartition(":")[2] == "0":
            raise ValueError(f"{KV_EVENTS_FLAG}: {field} {value!r} lets vLLM choose a port that only its "
                             f"/kv_event_sources tells, and the worker's record could not name it; give a fixed port")
    endpoint = config.get("endpoint")
    if not isinstance(endpoint, str) or publisher_binds(endpoint):
        return
    port = endpoint.rpartition(":")[2] if endpoint.startswith("tcp://") else "PORT"
    raise ValueError(f"{KV_EVENTS_FLAG}: endpoint {endpoint!r} makes vLLM's publisher connect instead of bind, "
                     f"so no subscriber ever gets an event; use 'tcp://*:{port}' (the worker's record then names "
                     f"its own host for subscribers) or an 'ipc://' path")
