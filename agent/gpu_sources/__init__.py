"""Where the agent's GPU facts come from, chosen by ``agent.gpu_source``: NVML on the node, this node's
dcgm-exporter ``/metrics`` page, or one Prometheus query for the whole fleet.

Each source answers one ``GpuReading`` per read (GPUs by node and index, and the pods dcgm-exporter says hold
them); the agent matches workers to GPUs over it with a pure function. Parsing is pure and unit-tested; HTTP
and NVML stay in thin adapters. A source never raises into the agent's tick: a failed read is an empty
reading, logged once per outage. Import the modules themselves; this file imports nothing.
"""
