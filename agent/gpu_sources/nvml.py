"""NVML on this node (``agent.gpus``) as a GPU source: every tick, in the loop (microseconds per call)."""

from __future__ import annotations

from agent.gpu_sources.reading import LOCAL_NODE, GpuReading
from agent.gpus import GpuReader


class NvmlSource:
    def __init__(self, reader: GpuReader) -> None:
        self._reader = reader

    async def read(self) -> GpuReading:
        return GpuReading(nodes={LOCAL_NODE: self._reader.read()})

    async def close(self) -> None:
        self._reader.close()
