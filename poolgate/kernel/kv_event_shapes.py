"""vLLM's KV-event message shapes (``vllm/distributed/kv_events.py``), declared once: the simulated worker
encodes batches with them and extproc decodes with them, so the two cannot drift apart.

Names only, no behaviour: the tag each event carries, the field order of each event as vLLM declares it (the
map keys of current releases, the array positions of releases before the change to maps) and the batch's
field order. Fields after ``group_idx`` exist only in the map form (``kv_cache_spec_kind``) and are read by
name or not at all.
"""

from __future__ import annotations

TAG_KEY = "type"
"""The map key holding an event's class name (msgspec's tagged union)."""
BLOCK_STORED = "BlockStored"
BLOCK_REMOVED = "BlockRemoved"
ALL_BLOCKS_CLEARED = "AllBlocksCleared"

BATCH_FIELDS = ("ts", "events", "data_parallel_rank")
"""``KVEventBatch``: an array in this order (older routers' maps use these keys)."""
BLOCK_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                       "lora_name", "extra_keys", "group_idx")
BLOCK_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
KV_CACHE_SPEC_KIND = "kv_cache_spec_kind"
"""A ``BlockStored`` map field of current releases (after ``group_idx``)."""

MEDIUM_GPU = "GPU"
FULL_ATTENTION = "full_attention"
