"""Builds the KV-event parts of one extproc process from its configuration: index, lookup, subscriptions."""

from __future__ import annotations

from collections.abc import Callable

from extproc.kvcache.index import PrefixIndex
from extproc.kvcache.lookup import CacheLookup
from extproc.kvcache.subscriber import KVEventSubscriptions
from extproc.kvcache.tokenizer import ChatTemplate, LocalTokenizer, PromptTokenizer, TokenizerError
from extproc.snapshot import FleetSnapshot
from poolgate.kernel.config import ConfigError, KvEventsSettings, PoolSpec


def pool_tokenizers(pools: tuple[PoolSpec, ...]) -> dict[str, PromptTokenizer]:
    """The configured tokenizers by pool; ConfigError (with the field path) if one cannot load."""
    tokenizers: dict[str, PromptTokenizer] = {}
    for index, pool in enumerate(pools):
        spec = pool.tokenizer
        if spec is None:
            continue
        try:
            tokenizers[pool.name] = LocalTokenizer(spec.path, ChatTemplate(spec.message, spec.reply, spec.prefix))
        except TokenizerError as error:
            raise ConfigError(f"pools[{index}].tokenizer.path: {error}") from error
    return tokenizers


def build_kv_cache(settings: KvEventsSettings, pools: tuple[PoolSpec, ...],
                   snapshot: Callable[[], FleetSnapshot]) -> tuple[CacheLookup, KVEventSubscriptions] | None:
    if not settings.enabled:
        return None
    index = PrefixIndex(settings.max_blocks, settings.pending_s)
    lookup = CacheLookup(index, snapshot, pool_tokenizers(pools))
    return lookup, KVEventSubscriptions(index, relearn_s=settings.relearn_s,
                                        replay_timeout_s=settings.replay_timeout_s)
