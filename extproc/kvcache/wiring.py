"""Builds the KV-event parts of one extproc process from its configuration: index, lookup, subscriptions."""

from __future__ import annotations

import logging
from collections.abc import Callable

from extproc.kvcache.index import PrefixIndex
from extproc.kvcache.lookup import CacheLookup
from extproc.kvcache.subscriber import KVEventSubscriptions
from extproc.kvcache.tokenizer import ChatTemplate, LocalTokenizer, PromptTokenizer, TokenizerError
from extproc.snapshot import FleetSnapshot
from poolgate.kernel.config import ConfigError, KvEventsSettings, PoolSpec

log = logging.getLogger(__name__)


def pool_tokenizers(pools: tuple[PoolSpec, ...]) -> dict[str, PromptTokenizer]:
    """The configured tokenizers by pool; ConfigError (with the field path) if one cannot load."""
    tokenizers: dict[str, PromptTokenizer] = {}
    for index, pool in enumerate(pools):
        spec = pool.tokenizer
        if spec is None:
            continue
        fallback = None if spec.message is None else ChatTemplate(spec.message, spec.reply, spec.prefix)
        try:
            tokenizer = LocalTokenizer(spec.path, fallback)
        except TokenizerError as error:
            raise ConfigError(f"pools[{index}].tokenizer.path: {error}") from error
        if fallback is not None and tokenizer.uses_model_template:
            log.warning("pools[%d].tokenizer: the model's own chat template renders chat; message, reply and "
                        "prefix are not used (remove them)", index)
        tokenizers[pool.name] = tokenizer
    return tokenizers


def build_kv_cache(settings: KvEventsSettings, pools: tuple[PoolSpec, ...],
                   snapshot: Callable[[], FleetSnapshot]) -> tuple[CacheLookup, KVEventSubscriptions] | None:
    if not settings.enabled:
        return None
    index = PrefixIndex(settings.max_blocks, settings.pending_s)
    lookup = CacheLookup(index, snapshot, pool_tokenizers(pools))
    return lookup, KVEventSubscriptions(index, relearn_s=settings.relearn_s,
                                        replay_timeout_s=settings.replay_timeout_s)
