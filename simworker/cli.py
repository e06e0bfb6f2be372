"""``poolgate simworker``: serve one or more simulated vLLM workers from one process.

Each ``--ports`` entry is an independent worker (own engine, KV cache, metrics registry, faults)
sharing one asyncio loop (uvloop when installed). SIGINT/SIGTERM stop them all cleanly (exit 0);
if every worker crashed through a fault the process exits with status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys

from poolgate.kernel.config import ConfigError, TlsServerFiles
from poolgate.kernel.heap import freeze_startup_objects
from poolgate.kernel.shutdown import on_stop_signal
from poolgate.kernel.tls import check_files
from simworker import model_tasks, registration
from simworker.engine import Engine
from simworker.faults import FaultSettings
from simworker.kv_publisher import KVEventsConfig
from simworker.kv_transfer import KVTransferConfig
from simworker.lora import DEFAULT_MAX_LORA_RANK
from simworker.presets import DEFAULT_PRESET, PRESETS, STEP_JITTER
from simworker.worker import SimWorker, WorkerSpec

log = logging.getLogger(__name__)

STOP_DEADLINE_S = 10.0
"""Open streams get half a second when the servers close; the rest is closing sockets."""

RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
API_KEY_ENV = "VLLM_API_KEY"
MAX_STEP_JITTER = 0.3
"""Cut at three deviations, this keeps every step above a tenth of its modelled time."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on (default %(default)s)")
    ports = parser.add_mutually_exclusive_group()
    ports.add_argument("--port", type=int, help="serve one worker on this port (default 8000)")
    ports.add_argument("--ports", type=int, nargs="+", help="serve one independent worker per port")
    ids = parser.add_mutually_exclusive_group()
    ids.add_argument("--worker-id", help="worker id for the single worker (default sim-<port>)")
    ids.add_argument("--worker-ids", nargs="+", help="one worker id per --ports entry")
    parser.add_argument("--model", default="sim-llama-3-8b", help="served model name (default %(default)s)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=DEFAULT_PRESET,
                        help="simulated GPU (default %(default)s)")
    parser.add_argument("--max-model-len", type=int, default=8192, help="prompt + output limit per request")
    parser.add_argument("--max-num-seqs", type=int, help="concurrent sequences cap (default from preset)")
    parser.add_argument("--max-num-batched-tokens", type=int, help="token budget per step (default from preset)")
    parser.add_argument("--num-gpu-blocks", type=int, help="override the KV cache size in blocks")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default %(default)s)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse cached prompt prefixes (default on, as in vLLM V1; "
                             "--no-enable-prefix-caching turns it off)")
    parser.add_argument("--kv-events-config", type=_kv_events_config, default=KVEventsConfig(),
                        help="vLLM's KV-cache events as JSON, e.g. '{\"enable_kv_cache_events\": true, "
                             "\"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\"}'; "
                             "with --ports each worker publishes on these ports plus its index")
    parser.add_argument("--kv-transfer-config", type=_kv_transfer_config, default=None,
                        help="vLLM's KV transfer for prefill/decode disaggregation as JSON, e.g. "
                             "'{\"kv_connector\": \"NixlConnector\", \"kv_role\": \"kv_producer\"}' "
                             "(kv_producer: prefill worker, kv_consumer: decode worker, kv_both); the link's "
                             "speed in kv_connector_extra_config.sim_link_gb_per_s (default 50, RDMA; NVLink "
                             "450) and the producer's hold time in sim_abort_timeout_s (default 480)")
    parser.add_argument("--legacy-kv-metric", action="store_true",
                        help="also export vllm:gpu_cache_usage_perc (the pre-V1 name)")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="run the modelled GPU this many times faster than real time (default 1)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the simulator's own randomness: step-time jitter and the error-rate fault, "
                             "mixed with each worker's id (default %(default)s); answer lengths depend on the "
                             "request only")
    parser.add_argument("--step-jitter", type=float, default=STEP_JITTER,
                        help="relative standard deviation of each step's time, cut at three of them "
                             "(default %(default)s; 0 for exact modelled times)")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                        help=f"require this key on /v1 paths, as vLLM does (default: ${API_KEY_ENV})")
    tls = parser.add_argument_group("HTTPS (vLLM's flags)")
    tls.add_argument("--ssl-certfile", help="serve HTTPS with this certificate chain (PEM)")
    tls.add_argument("--ssl-keyfile", help="the certificate's private key (PEM)")
    tls.add_argument("--ssl-ca-certs", help="require client certificates signed by this CA bundle (PEM)")
    model_tasks.add_arguments(parser)
    lora = parser.add_argument_group("LoRA adapters")
    lora.add_argument("--enable-lora", action="store_true",
                      help="serve LoRA adapters; the load/unload endpoints also need "
                           f"{RUNTIME_LORA_ENV}=True in the environment, as with vLLM")
    lora.add_argument("--max-loras", type=int, default=1, help="adapters loaded at once (default %(default)s)")
    lora.add_argument("--max-lora-rank", type=int, default=DEFAULT_MAX_LORA_RANK,
                      help="refuse to load adapters of a higher rank (default %(default)s, as vLLM)")
    lora.add_argument("--lora-load-s", type=float, default=0.0, help="seconds one adapter load takes")
    faults = parser.add_argument_group("faults")
    faults.add_argument("--enable-fault-api", action="store_true",
                        help="serve GET/POST /sim/faults to change faults at run time")
    faults.add_argument("--error-rate", type=float, default=0.0, help="share of requests answered with 500")
    faults.add_argument("--added-latency-s", type=float, default=0.0, help="delay before each request runs")
    faults.add_argument("--hang", action="store_true", help="accept requests and never answer")
    faults.add_argument("--crash-after-requests", type=int, help="crash on the request after this many")
    faults.add_argument("--crash-at-s", type=float, help="crash this many seconds after start")
    faults.add_argument("--kv-leak-blocks-per-s", type=float, default=0.0, help="KV blocks lost per second")
    faults.add_argument("--slow-start-s", type=float, default=0.0, help="report 503 for this long after start")
    parser.add_argument("--startup-delay-s", type=float, default=0.0,
                        help="model load time: open the port (and so /health) only this long after start, as "
                             "vLLM does once its engine is built (default %(default)s; a real start takes "
                             "seconds to minutes)")
    parser.add_argument("--enable-sleep-mode", action="store_true",
                        help="serve POST /sleep, POST /wake_up and GET /is_sleeping, as vLLM does with this flag")
    parser.add_argument("--wake-up-s", type=float, default=1.0,
                        help="seconds a wake-up from sleep takes (default %(default)s)")
    parser.add_argument("--log-level", default="INFO", help="logging level (default %(default)s)")
    registration.add_arguments(parser)


def _kv_events_config(text: str) -> KVEventsConfig:
    try:
        return KVEventsConfig.from_json(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def _kv_transfer_config(text: str) -> KVTransferConfig:
    try:
        return KVTransferConfig.from_json(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def worker_specs(args: argparse.Namespace) -> list[WorkerSpec]:
    """Turn parsed flags into one spec per port; ValueError explains a bad combination."""
    ports: list[int] = args.ports or [args.port or 8000]
    if len(set(ports)) != len(ports):
        raise ValueError("--ports lists a port twice")
    if args.worker_ids is not None and len(args.worker_ids) != len(ports):
        raise ValueError(f"--worker-ids needs one id per port ({len(ports)} ports)")
    if args.max_loras < 1:
        raise ValueError("--max-loras must be at least 1")
    if args.max_lora_rank < 1:
        raise ValueError("--max-lora-rank must be at least 1")
    if args.lora_load_s < 0:
        raise ValueError("--lora-load-s must be 0 or more")
    if args.startup_delay_s < 0 or args.wake_up_s < 0:
        raise ValueError("--startup-delay-s and --wake-up-s must be 0 or more")
    if not 0 <= args.step_jitter <= MAX_STEP_JITTER:
        raise ValueError(f"--step-jitter must be between 0 and {MAX_STEP_JITTER}")
    runtime_lora = os.environ.get(RUNTIME_LORA_ENV, "").lower() in ("true", "1")
    if args.enable_lora and runtime_lora:
        log.warning("%s is set: adapters can be loaded at run time (meant for trusted use)", RUNTIME_LORA_ENV)
    if args.worker_id is not None and len(ports) != 1:
        raise ValueError("--worker-id is for a single worker; use --worker-ids with --ports")
    tasks = model_tasks.from_args(args)
    ids = args.worker_ids or ([args.worker_id] if args.worker_id else [f"sim-{port}" for port in ports])
    faults = FaultSettings(
        error_rate=args.error_rate, added_latency_s=args.added_latency_s, hang=args.hang,
        crash_after_requests=args.crash_after_requests, crash_at_s=args.crash_at_s,
        kv_leak_blocks_per_s=args.kv_leak_blocks_per_s, slow_start_s=args.slow_start_s,
    )
    return [
        WorkerSpec(
            port=port, worker_id=worker_id, preset=PRESETS[args.preset], host=args.host,
            model_name=args.model, block_size=args.block_size, max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            num_gpu_blocks=args.num_gpu_blocks, enable_prefix_caching=args.enable_prefix_caching,
            legacy_kv_metric=args.legacy_kv_metric, time_scale=args.time_scale, faults=faults,
            enable_fault_api=args.enable_fault_api, enable_lora=args.enable_lora, max_loras=args.max_loras,
            max_lora_rank=args.max_lora_rank,
            lora_load_s=args.lora_load_s, runtime_lora_updating=runtime_lora, api_key=args.api_key,
            seed=args.seed, step_jitter=args.step_jitter, kv_events=args.kv_events_config.offset(index),
            tasks=tasks, kv_transfer=args.kv_transfer_config, tls=_tls_files(args),
            startup_delay_s=args.startup_delay_s, enable_sleep_mode=args.enable_sleep_mode,
            wake_up_s=args.wake_up_s,
        )
        for index, (port, worker_id) in enumerate(zip(ports, ids, strict=True))
    ]


def _tls_files(args: argparse.Namespace) -> TlsServerFiles | None:
    if not args.ssl_certfile and not args.ssl_keyfile:
        if args.ssl_ca_certs:
            raise ValueError("--ssl-ca-certs needs --ssl-certfile and --ssl-keyfile")
        return None
    if not (args.ssl_certfile and args.ssl_keyfile):
        raise ValueError("--ssl-certfile and --ssl-keyfile go together")
    return TlsServerFiles(cert_file=args.ssl_certfile, key_file=args.ssl_keyfile, client_ca_file=args.ssl_ca_certs)


async def serve_workers(workers: list[SimWorker], stop: asyncio.Event) -> int:
    """Serve until ``stop``; 1 if every worker crashed, else 0."""
    async with asyncio.TaskGroup() as tasks:
        for worker in workers:
            tasks.create_task(worker.serve(stop))
    return 1 if all(worker.crashed.is_set() for worker in workers) and not stop.is_set() else 0


async def _run(specs: list[WorkerSpec], args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    on_stop_signal(asyncio.get_running_loop(), stop.set, STOP_DEADLINE_S)
    workers = [SimWorker(spec) for spec in specs]
    freeze_startup_objects()
    registrations = [asyncio.create_task(registration.keep_registered(args, worker, stop)) for worker in workers]
    try:
        return await serve_workers(workers, stop)
    finally:
        stop.set()
        await asyncio.gather(*registrations, return_exceptions=True)


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        specs = worker_specs(args)
        registration.check(args)
        for spec in specs:
            Engine(spec.engine_config())  # fail fast on a model or context that does not fit the card
            if spec.tls is not None:
                check_files(spec.tls, "--ssl-certfile/--ssl-keyfile/--ssl-ca-certs")
    except (ValueError, ConfigError) as error:
        print(f"poolgate simworker: {error}", file=sys.stderr)
        return 2
    runner_factory = None
    with contextlib.suppress(ImportError):
        import uvloop

        runner_factory = uvloop.new_event_loop
    try:
        with asyncio.Runner(loop_factory=runner_factory) as runner:
            return runner.run(_run(specs, args))
    except* OSError as group:
        for failure in group.exceptions:
            print(f"poolgate simworker: cannot listen: {failure}", file=sys.stderr)
    return 2
