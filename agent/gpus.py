"""GPU memory and utilisation through NVML, behind a narrow interface so tests need no driver.

NVML is optional: with the setting ``off``, without the ``pynvml`` module or without a driver, the agent
gets no reader (logged once) and falls back to what workers report themselves. A worker's GPUs are named
by index (``WorkerSpec.gpus``, the same numbers as ``CUDA_VISIBLE_DEVICES``) or by UUID (``GPU-…``).
"""

from __future__ import annotations

import importlib
import logging
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger("poolgate.agent.gpus")

MIB = 1024 * 1024


class Nvml(Protocol):
    """The part of the NVML binding the agent uses (``pynvml`` / ``nvidia-ml-py`` names)."""

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:
        """An object with ``total``, ``free`` and ``used`` in bytes."""

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        """An object with ``gpu``: percent of the last sample period in which a kernel ran."""

    def nvmlDeviceGetUUID(self, handle: Any) -> str | bytes: ...


@dataclass(frozen=True)
class GpuSample:
    index: int
    uuid: str
    memory_total_mib: float
    memory_free_mib: float
    memory_used_mib: float
    utilization: float
    """0..1"""


@dataclass(frozen=True)
class GpuSummary:
    """A worker's GPUs taken together: memory summed, utilisation averaged."""

    memory_total_mib: float
    memory_free_mib: float
    utilization: float


class GpuReader:
    """Reads every GPU of this node; a device that fails to answer is left out of that reading."""

    def __init__(self, nvml: Nvml) -> None:
        self._nvml = nvml
        self._count = nvml.nvmlDeviceGetCount()
        self._failing: set[int] = set()

    @property
    def count(self) -> int:
        return self._count

    def read(self) -> dict[int, GpuSample]:
        samples: dict[int, GpuSample] = {}
        for index in range(self._count):
            try:
                samples[index] = self._read_one(index)
            except Exception as exc:  # NVML raises its own error per device (lost, reset, no permission)
                if index not in self._failing:
                    log.warning("GPU %d does not answer NVML (%s); its workers show no GPU facts", index, exc)
                    self._failing.add(index)
                continue
            if index in self._failing:
                log.info("GPU %d answers NVML again", index)
                self._failing.discard(index)
        return samples

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except Exception as exc:  # shutting down a library that is half gone must not fail the agent's exit
            log.debug("nvmlShutdown failed: %s", exc)

    def _read_one(self, index: int) -> GpuSample:
        handle = self._nvml.nvmlDeviceGetHandleByIndex(index)
        memory = self._nvml.nvmlDeviceGetMemoryInfo(handle)
        rates = self._nvml.nvmlDeviceGetUtilizationRates(handle)
        uuid = self._nvml.nvmlDeviceGetUUID(handle)
        return GpuSample(
            index=index, uuid=uuid.decode() if isinstance(uuid, bytes) else str(uuid),
            memory_total_mib=memory.total / MIB, memory_free_mib=memory.free / MIB,
            memory_used_mib=memory.used / MIB, utilization=min(1.0, max(0.0, float(rates.gpu) / 100.0)),
        )


def _import_pynvml() -> Nvml:
    with warnings.catch_warnings():
        # The ``pynvml`` wrapper package warns on import that it is a mere alias of ``nvidia-ml-py``.
        warnings.simplefilter("ignore", FutureWarning)
        module: Nvml = importlib.import_module("pynvml")  # type: ignore[assignment]
    return module


def open_gpus(setting: str, load: Callable[[], Nvml] = _import_pynvml) -> GpuReader | None:
    """A reader for this node's GPUs, or None when NVML is off or unavailable (logged once, here)."""
    if setting == "off":
        log.info("NVML off by configuration; GPU facts come from the workers' own metrics only")
        return None
    try:
        nvml = load()
    except ImportError as exc:
        log.info("NVML binding not installed (%s); GPU facts come from the workers' own metrics only", exc)
        return None
    try:
        nvml.nvmlInit()
        reader = GpuReader(nvml)
    except Exception as exc:  # NVMLError_LibraryNotFound / DriverNotLoaded / ...: a node without GPUs
        log.info("NVML unavailable (%s); GPU facts come from the workers' own metrics only", exc)
        return None
    log.info("NVML sees %d GPU(s)", reader.count)
    return reader


def parse_visible_devices(value: str | None) -> tuple[str, ...]:
    """``CUDA_VISIBLE_DEVICES`` as a tuple of entries (indices or UUIDs); empty when unset or blank."""
    if not value:
        return ()
    return tuple(part.strip() for part in value.split(",") if part.strip())


def summarize(samples: Mapping[int, GpuSample], devices: Iterable[int | str]) -> GpuSummary | None:
    """The worker's GPUs out of one reading; None if it names none or any of them was not read."""
    by_uuid = {sample.uuid: sample for sample in samples.values()}
    chosen: list[GpuSample] = []
    for device in devices:
        text = str(device)
        sample = samples.get(int(text)) if text.isdigit() else by_uuid.get(text)
        if sample is None:
            return None
        chosen.append(sample)
    return combine(chosen)


def combine(chosen: Sequence[GpuSample]) -> GpuSummary | None:
    """Several GPUs of one worker as one: memory summed, utilisation averaged; None for none."""
    if not chosen:
        return None
    return GpuSummary(
        memory_total_mib=sum(s.memory_total_mib for s in chosen),
        memory_free_mib=sum(s.memory_free_mib for s in chosen),
        utilization=sum(s.utilization for s in chosen) / len(chosen),
    )
