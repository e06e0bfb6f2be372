"""From a request to cached-prefix lengths and the cache-aware scorer: the prompt tokenised as the engine
tokenises it, looked up in an index fed by events, and the warm-vs-cold trade-off in predicted TTFT."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import orjson
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from extproc.kvcache.blocks import PromptBlocks
from extproc.kvcache.index import PrefixIndex
from extproc.kvcache.keys import prompt_keys
from extproc.kvcache.lookup import CacheLookup
from extproc.kvcache.tokenizer import ChatTemplate, LocalTokenizer, SimTokenizer, prompt_token_ids
from extproc.kvcache.wire import EventBatch, Stored
from extproc.request import RequestFacts
from extproc.scheduling import PickContext, PickRequest
from extproc.scheduling.scorers.cache_aware_ttft import CacheAwareTtft
from extproc.snapshot import build_snapshot
from poolgate.kernel.config import PoolSpec
from poolgate.kernel.fleet import WorkerRecord
from simworker import protocol, tokens

NOW = 1_000.0
POOLS = (PoolSpec(name="chat", model="llama"),)
CHAT = {"model": "llama", "messages": [{"role": "system", "content": "You answer briefly."},
                                       {"role": "user", "content": [{"type": "text", "text": "Hello, there!"},
                                                                    {"type": "text", "text": "How are you?"}]}]}


def test_the_router_makes_the_simulated_engines_token_ids_for_chat_and_completions() -> None:
    engine_chat = protocol.parse_chat(CHAT)
    assert prompt_token_ids(CHAT, SimTokenizer()) == tokens.token_ids(engine_chat.prompt_tokens)
    completion = {"model": "llama", "prompt": "def add(a, b):\n    return a + b"}
    assert prompt_token_ids(completion, SimTokenizer()) == tokens.token_ids(
        protocol.parse_completion(completion).prompt_tokens)
    ids = {"model": "llama", "prompt": [5, 17, 9]}
    assert prompt_token_ids(ids, SimTokenizer()) == tokens.token_ids(protocol.parse_completion(ids).prompt_tokens)


@pytest.mark.parametrize("body", [{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                                  {"prompt": ["a", "b"]}, {"prompt": 3}, {"messages": []}])
def test_prompts_that_are_not_plain_text_are_not_looked_up(body: dict[str, object]) -> None:
    assert prompt_token_ids(body, SimTokenizer()) is None


def test_a_local_tokenizer_json_with_the_pools_chat_template(tmp_path: Path) -> None:
    vocab = {"[UNK]": 0, "<s>": 1, "<h>": 2, "</h>": 3, "<e>": 4, "user": 5, "assistant": 6, "hello": 7, "world": 8}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    local = LocalTokenizer(str(tmp_path), ChatTemplate(message="<h> {role} </h> {content} <e> ",
                                                       reply="<h> assistant </h>", prefix="<s> "))
    body = {"messages": [{"role": "user", "content": "hello world"}]}
    assert prompt_token_ids(body, local) == [1, 2, 5, 3, 7, 8, 4, 2, 6, 3]
    assert json.loads((tmp_path / "tokenizer.json").read_text())["model"]["type"] == "WordLevel"


def worker(worker_id: str, **fields: object) -> WorkerRecord:
    return WorkerRecord(id=worker_id, pool="chat", model="llama", host="h", port=1, updated_at=NOW, backend="sim",
                        kv_events_endpoint=f"tcp://h:{len(worker_id)}", kv_block_size=16,
                        prefill_tokens_per_s=10_000.0, **fields)  # type: ignore[arg-type]


def indexed(workers: list[WorkerRecord], held: dict[str, int], token_ids: list[int]) -> CacheLookup:
    """A lookup over an index in which each worker holds its first ``held[w]`` blocks of ``token_ids``."""
    index = PrefixIndex()
    for w in workers:
        index.mark_known(w.id)
        blocks = held.get(w.id, 0)
        if blocks:
            stored = Stored(tuple(range(blocks)), None, tuple(token_ids[:blocks * 16]), 16)
            index.apply(w.id, EventBatch(0.0, (stored,)))
    snapshot = build_snapshot(workers, POOLS, NOW, 3.0)
    return CacheLookup(index, lambda: snapshot, clock=lambda: NOW)


def pick_request(body: dict[str, object], lookup: CacheLookup) -> PickRequest:
    facts = RequestFacts("/v1/chat/completions", "POST", "llama")
    request = PickRequest(facts, 100, 100, 10, "short_chat")
    assert lookup.wants(request)
    return asyncio.run(lookup.prepare(request, orjson.dumps(body)))


def long_body(words: int) -> dict[str, object]:
    return {"model": "llama", "messages": [{"role": "user", "content": " ".join(f"w{i}" for i in range(words))}]}


def test_the_lookup_gives_each_known_worker_its_exact_cached_prefix() -> None:
    body = long_body(6000)  # ~6k tokens, over the inline limit: tokenised in a thread
    token_ids = prompt_token_ids(body, SimTokenizer())
    assert token_ids is not None
    workers = [worker("warm"), worker("cold"), worker("x")]
    lookup = indexed(workers, {"warm": 300}, token_ids)
    request = pick_request(body, lookup)
    assert request.prompt_blocks is not None and request.prompt_blocks.token_count == len(token_ids)
    assert lookup.cached_tokens(request.prompt_blocks, workers) == {"warm": 4800, "cold": 0, "x": 0}
    cold = lookup.placed(workers[1], request)  # this replica just sent it to "cold": pending there
    assert cold is not None
    assert lookup.cached_tokens(request.prompt_blocks, workers)["cold"] == len(token_ids) // 16 * 16
    assert (len(cold.keys), cold.counted) == (len(token_ids) // 16, 0)  # every block news to the replicas elsewhere
    assert (cold.prompt_tokens, cold.held_tokens, cold.held_or_pending_tokens) == (len(token_ids), 0, 0)
    warm = lookup.placed(workers[0], request)
    assert warm is not None and warm.counted == 300  # "warm" held its first 300: only the rest is news
    assert warm.held_tokens == warm.held_or_pending_tokens == 4800
    again = lookup.placed(workers[1], request)  # a second question about it: nothing new, all of it pending
    assert again is not None and again.counted == len(cold.keys)
    assert (again.held_tokens, again.held_or_pending_tokens) == (0, len(token_ids) // 16 * 16)


def test_blocks_another_replica_placed_count_as_pending_on_their_worker() -> None:
    body = long_body(600)
    token_ids = prompt_token_ids(body, SimTokenizer())
    assert token_ids is not None
    workers = [worker("a"), worker("b")]
    here, elsewhere = indexed(workers, {}, token_ids), indexed(workers, {}, token_ids)
    request = pick_request(body, here)
    placed = elsewhere.placed(workers[1], request)
    assert placed is not None
    here.placed_elsewhere("b", placed.keys[placed.counted:])
    assert request.prompt_blocks is not None
    whole = min(len(placed.keys) * 16, len(token_ids) - 1)  # a whole-prompt match still computes its last token
    assert here.cached_tokens(request.prompt_blocks, workers) == {"a": 0, "b": whole}
    assert here.cached_tokens(request.prompt_blocks, workers, pending=False) == {"a": 0, "b": 0}


def test_a_picks_view_answers_every_stage_from_one_walk_and_as_the_lookup_does() -> None:
    body = long_body(3000)
    token_ids = prompt_token_ids(body, SimTokenizer())
    assert token_ids is not None
    workers = [worker("warm"), worker("half"), worker("cold"), worker("x")]
    lookup = indexed(workers, {"warm": 150, "half": 70}, token_ids)
    request = pick_request(body, lookup)
    lookup.placed(workers[2], request)  # pending on "cold"
    blocks = request.prompt_blocks
    assert blocks is not None
    walks = []
    walk = lookup.index.cached_prefixes
    lookup.index.cached_prefixes = lambda *args: walks.append(args) or walk(*args)  # type: ignore[method-assign]
    view = lookup.for_pick()
    answers = [view.cached_tokens(blocks, workers, pending=False),  # the KV filter, over every candidate
               view.cached_tokens(blocks, workers[:3]),  # the latency, over the filter's survivors
               view.cached_tokens(blocks, workers[1:3], pending=False)]
    assert len(walks) == 1
    assert answers == [lookup.cached_tokens(blocks, workers, pending=False), lookup.cached_tokens(blocks, workers[:3]),
                       lookup.cached_tokens(blocks, workers[1:3], pending=False)]
    assert answers[0] == {"warm": 2400, "half": 1120, "cold": 0, "x": 0}
    assert answers[1]["cold"] == min(len(token_ids) // 16 * 16, len(token_ids) - 1)  # pending: the whole prompt
    other = replace(blocks, keys=dict(blocks.keys))  # another prompt: worked out anew
    view.cached_tokens(other, workers)
    assert len(walks) == 5  # 1 + the three lookups above + this one


def scorer_scores(request: PickRequest, workers: list[WorkerRecord], lookup: CacheLookup,
                  pending: dict[str, int] | None = None) -> list[float]:
    context = PickContext(build_snapshot(workers, POOLS, NOW, 3.0), {}, pending_prefill_tokens=pending or {},
                          prefix_cache=lookup)
    return list(CacheAwareTtft(8000.0, 0.5).score(request, workers, context))


@pytest.mark.parametrize(("queued", "warm_wins"), [(0, True), (3000, True), (5000, True), (7000, False)])
def test_a_warm_worker_beats_an_idle_cold_one_until_its_queue_costs_more_than_the_prefill_it_saves(
        queued: int, warm_wins: bool) -> None:
    token_ids = list(range(1, 6401))  # 6400 tokens = 400 blocks; warm holds 375 of them (6000 tokens)
    workers = [worker("warm"), worker("cold")]
    lookup = indexed(workers, {"warm": 375}, token_ids)
    request = pick_request({"model": "llama", "prompt": token_ids}, lookup)
    warm, cold = scorer_scores(request, workers, lookup, pending={"warm": queued})
    # t(warm) = (queued + 6400 - 6000) / 10k, t(cold) = 6400 / 10k
    assert warm == pytest.approx(0.5 / (0.5 + (queued + 400) / 10_000))
    assert cold == pytest.approx(0.5 / (0.5 + 0.64))
    assert (warm > cold) is warm_wins


@pytest.mark.parametrize(("waiting", "warm_wins"), [(0, True), (3, True), (14, True), (16, False)])
def test_waiting_requests_cost_what_this_one_costs_on_their_worker(waiting: int, warm_wins: bool) -> None:
    """t(w) = ((waiting + 1) × (P − c) + pending) / rate: warm (waiting + 1) × 400 against cold 6400."""
    token_ids = list(range(1, 6401))
    workers = [worker("warm", waiting=waiting), worker("cold")]
    lookup = indexed(workers, {"warm": 375}, token_ids)
    request = pick_request({"model": "llama", "prompt": token_ids}, lookup)
    warm, cold = scorer_scores(request, workers, lookup)
    assert warm == pytest.approx(0.5 / (0.5 + (waiting + 1) * 400 / 10_000))
    assert (warm > cold) is warm_wins


def test_without_precise_knowledge_every_candidate_scores_alike() -> None:
    workers = [worker("a"), worker("b", waiting=5)]
    request = PickRequest(RequestFacts("/v1/chat/completions", "POST", "llama"), 100, 100, 10, "short_chat")
    lookup = indexed(workers, {}, [])
    assert scorer_scores(request, workers, lookup) == [0.0, 0.0]  # not tokenised
    blocks = PromptBlocks(64, {16: prompt_keys(list(range(64)), 16)})
    unknown = CacheLookup(PrefixIndex(), lambda: build_snapshot(workers, POOLS, NOW, 3.0))
    assert scorer_scores(replace(request, prompt_blocks=blocks), workers, unknown) == [0.0, 0.0]


def test_an_unknown_worker_is_estimated_from_the_affinity_map_not_taken_as_empty() -> None:
    token_ids = list(range(1, 1601))
    workers = [worker("known"), worker("unknown")]
    lookup = indexed([workers[0]], {}, token_ids)
    request = pick_request({"model": "llama", "prompt": token_ids}, lookup)
    request = replace(request, affinity_keys=("p",))
    context = PickContext(build_snapshot(workers, POOLS, NOW, 3.0), {}, affinity={"p": "unknown"},
                          prefix_cache=lookup)
    known, unknown = CacheAwareTtft(8000.0, 0.5).score(request, workers, context)
    assert unknown == pytest.approx(1.0) and known == pytest.approx(0.5 / (0.5 + 0.16))
