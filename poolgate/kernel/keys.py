"""Every Redis key name poolgate uses, under one prefix; nothing else spells a key.

Fleet keys all begin with the prefix in braces, ``{poolgate}:…`` (the braces are literal: they are the
fleet's Redis Cluster hash tag). Cluster hashes only the tag, so every fleet key lies in one slot on one
master, and the fleet's scripts and pipelines, which touch many of them at once, run there in one step;
a single server or Sentinel's master ignores the braces. The fleet is written per worker and heartbeat,
never per request, so one slot carries it; the per-request quota keys spread over the cluster, one slot
per tenant. Fleet keys (``{prefix}`` below is that braced tag):

- ``{prefix}:worker:{id}``  hash: one ``WorkerRecord`` (identity and live facts). Readers remove it once its
  heartbeats stop (``fleet:deadlines``); it expires on its own ``EXPIRY_HOLD_MS`` later.
- ``{prefix}:workers``      set of worker ids (an index; readers prune ids whose hash has expired).
- ``{prefix}:inflight``     hash: worker id → cross-replica count of requests extproc has in flight on it
  (a worker with none has no field, so a reader's one read costs the busy workers, not the fleet).
- ``{prefix}:events``       pub/sub channel; each message (``register ID V``, ``update ID V``, ``deregister ID
  V``, ``expire ID V``; V is the fleet version of the change) means "the fleet changed, refresh now".
- ``{prefix}:fleet:version`` the fleet version: bumped by every change readers must see.
- ``{prefix}:fleet:changed`` sorted set, worker id → version of its last membership, identity or state change.
- ``{prefix}:fleet:live``   sorted set, worker id → version of its last live-facts change (KV, queue, GPUs).
- ``{prefix}:fleet:deadlines`` sorted set, worker id → its heartbeat deadline (Redis clock, ms): the first
  reader to look after that removes the record and writes the expiry as a change, unless too many workers are
  overdue at once (the mass-expiry guard, ``poolgate.kernel.store_scripts.POLL``).
- ``{prefix}:fleet:registry_at`` when (Redis clock, ms) a registry API process last said it serves: a worker
  whose deadline passed after that is held, not expired (its registry, not the worker, went quiet).
- ``{prefix}:fleet:registry_settled_at`` when (ms) the workers of a registry that came back after a silence
  have had one TTL to reach it: an overdue worker whose deadline is earlier is held.
- ``{prefix}:fleet:floor``  the version below which the change logs were trimmed (older readers read all).
- ``{prefix}:fleet:epoch``  set with the first version: a new epoch means Redis lost its data.
- ``{prefix}:passive``      hash: worker id → count of data-path failures (5xx, timeouts, resets before
  headers) seen on it; the controller's health monitor reads their growth each round, in one read as
  large as the workers that failed. It expires a minute after the last failure; the monitor removes the
  fields of workers that left.
- ``{prefix}:queued:{pool}`` hash: requests each extproc replica holds in its queue for a pool (field =
  replica id, value = its current count, expiring a few seconds after the last write so a dead replica's
  count fades); the autoscaler reads the sum as queue pressure.
- ``{prefix}:leader``       the controller leader lease (holder id, ``SET NX PX``).
- ``{prefix}:controller``   the leader controller's API base URL, for operator commands.
- ``{prefix}:drains``       hash: worker id → how its drain ends (``stop`` or ``restart``) and when it began
  (epoch seconds), written by the leader when a drain starts and removed when it ends, so a controller
  that takes the lease over finishes the drains the old leader left.

The peer exchange's keys (``RedisKeys.peers``) are fleet keys too (``extproc.peers``). Tenant quota keys
(``RedisKeys.quota``: ``prefix:quota:{tenant:NAME}:…``, no braces on the prefix) are described where they
are used, in ``extproc.quota``.
"""

from __future__ import annotations


class QuotaKeys:
    """A tenant's quota keys; ``{tenant:NAME}`` is their common Redis Cluster hash tag (one slot per tenant,
    as a multi-key script needs)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def tenant(self, name: str) -> str:
        """The common part of a tenant's keys."""
        return f"{self.prefix}:quota:{{tenant:{name}}}"

    def concurrent(self, name: str) -> str:
        return f"{self.tenant(name)}:concurrent"

    def request_buckets(self, name: str) -> str:
        """Per-second request counts (hash: second → requests)."""
        return f"{self.tenant(name)}:rpm"

    def token_buckets(self, name: str) -> str:
        """Per-second token charges (hash: second → tokens)."""
        return f"{self.tenant(name)}:tpm"

    def tokens(self, name: str, minute: int) -> str:
        """Tokens charged in calendar minute ``minute`` (= ⌊t / 60⌋): accounting only."""
        return f"{self.tenant(name)}:tpm:{minute}"

    def charged(self, name: str, batch_id: str) -> str:
        """Marks a batch of charges kept while Redis was away as written (so a resent batch is not counted twice)."""
        return f"{self.tenant(name)}:charged:{batch_id}"


def fleet_tag(prefix: str) -> str:
    """The fleet keys' common beginning: the prefix as one Redis Cluster hash tag."""
    return f"{{{prefix}}}"


class PeerKeys:
    """What extproc replicas tell each other (``extproc/peers.py``): who is alive, each one's reservations,
    their affinity records (a stream) and the best class each holds waiting per pool. In the fleet's slot: the
    watcher writes them in the same pipeline as the in-flight counts."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.replicas = f"{fleet_tag(prefix)}:extproc:replicas"
        self.affinity = f"{fleet_tag(prefix)}:extproc:affinity"
        self.reserved = f"{fleet_tag(prefix)}:extproc:reserved"
        self.waiting = f"{fleet_tag(prefix)}:extproc:waiting"


class RedisKeys:
    """Key names under one prefix: the fleet's here (all beginning with ``fleet``, the hash tag the store's
    scripts build their key names from), the peers' in ``peers``, the tenants' quotas in ``quota``."""

    def __init__(self, prefix: str = "poolgate") -> None:
        self.prefix = prefix
        self.fleet = fleet = fleet_tag(prefix)
        self.workers = f"{fleet}:workers"
        self.events = f"{fleet}:events"
        self.leader = f"{fleet}:leader"
        self.controller = f"{fleet}:controller"
        self.drains = f"{fleet}:drains"
        self.inflight = f"{fleet}:inflight"
        self.passive = f"{fleet}:passive"
        self.fleet_version = f"{fleet}:fleet:version"
        self.fleet_epoch = f"{fleet}:fleet:epoch"
        self.peers = PeerKeys(prefix)
        self.quota = QuotaKeys(prefix)

    def worker(self, worker_id: str) -> str:
        return f"{self.fleet}:worker:{worker_id}"

    def queued(self, pool: str) -> str:
        return f"{self.fleet}:queued:{pool}"
