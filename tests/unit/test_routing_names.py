"""Cluster names that the controller (building clusters) and extproc (naming one per request) must agree on."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from poolgate.kernel.routing import cluster_name, pool_clusters, worker_cluster


def test_a_workers_shard_is_the_same_in_another_process() -> None:
    """The controller and extproc are separate processes, where Python's own ``hash`` of a string differs: the
    shard a worker hashes to must not."""
    ids = [f"worker-{i}" for i in range(64)]
    script = ("import json, sys; from poolgate.kernel.routing import worker_cluster; "
              "print(json.dumps([worker_cluster('chat', i, 7) for i in json.loads(sys.argv[1])]))")
    other = subprocess.run([sys.executable, "-c", script, json.dumps(ids)], capture_output=True, text=True,
                           check=True, env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert json.loads(other.stdout) == [worker_cluster("chat", i, 7) for i in ids]


def test_every_worker_lands_in_one_of_its_pools_clusters() -> None:
    clusters = pool_clusters("chat", 7)
    assert len(set(clusters)) == 7
    assert {worker_cluster("chat", f"w{i}", 7) for i in range(500)} == set(clusters)
    assert pool_clusters("chat") == (cluster_name("chat"),) == (worker_cluster("chat", "w1"),)


def test_shard_names_never_meet_another_pools_name() -> None:
    """Pool names allow letters, digits and dashes only: a shard of pool ``a`` is never pool ``a-1``'s cluster."""
    assert not set(pool_clusters("a", 4)) & {cluster_name(f"a-{k}") for k in range(4)}
