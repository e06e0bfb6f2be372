"""NVML reading through a stand-in driver; one check against the real driver where a GPU exists."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import pytest

from agent.gpus import MIB, GpuReader, GpuSample, Nvml, open_gpus, parse_visible_devices, summarize
from controller.placement import GpuFree, place


class FakeNvmlError(Exception):
    """Stands in for pynvml.NVMLError."""


@dataclass
class FakeMemory:
    total: int
    free: int
    used: int


@dataclass
class FakeUtilization:
    gpu: int
    memory: int = 0


@dataclass
class FakeGpu:
    uuid: str
    total_mib: int
    used_mib: int
    utilization_percent: int
    broken: bool = False


@dataclass
class FakeNvml:
    """An NVML driver with scripted GPUs; records init/shutdown so lifecycle can be asserted."""

    gpus: list[FakeGpu] = field(default_factory=list)
    init_error: Exception | None = None
    initialized: bool = False
    shut_down: bool = False

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self.shut_down = True

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        return self.gpus[index]

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:
        gpu: FakeGpu = handle
        if gpu.broken:
            raise FakeNvmlError("GPU is lost")
        return FakeMemory(total=gpu.total_mib * MIB, free=(gpu.total_mib - gpu.used_mib) * MIB,
                          used=gpu.used_mib * MIB)

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        return FakeUtilization(gpu=handle.utilization_percent)

    def nvmlDeviceGetUUID(self, handle: Any) -> str | bytes:
        return handle.uuid.encode()  # older bindings return bytes


def two_gpus() -> FakeNvml:
    return FakeNvml(gpus=[FakeGpu("GPU-aaaa", 81920, 20480, 30), FakeGpu("GPU-bbbb", 81920, 81000, 90)])


def test_reads_every_gpu() -> None:
    nvml = two_gpus()
    reader = open_gpus("auto", lambda: nvml)
    assert reader is not None and nvml.initialized and reader.count == 2
    assert reader.read() == {
        0: GpuSample(index=0, uuid="GPU-aaaa", memory_total_mib=81920, memory_free_mib=61440,
                     memory_used_mib=20480, utilization=0.3),
        1: GpuSample(index=1, uuid="GPU-bbbb", memory_total_mib=81920, memory_free_mib=920,
                     memory_used_mib=81000, utilization=0.9),
    }
    reader.close()
    assert nvml.shut_down


def test_a_failing_gpu_is_left_out_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    nvml = two_gpus()
    reader = GpuReader(nvml)
    nvml.gpus[1].broken = True
    with caplog.at_level(logging.WARNING, logger="poolgate.agent.gpus"):
        assert set(reader.read()) == {0}
        assert set(reader.read()) == {0}
    assert sum("GPU 1" in r.message for r in caplog.records) == 1
    nvml.gpus[1].broken = False
    assert set(reader.read()) == {0, 1}


def failing_import() -> Nvml:
    raise ImportError("No module named 'pynvml'")


@pytest.mark.parametrize(("setting", "load"), [
    ("off", two_gpus),                                             # configured off: not even loaded
    ("auto", failing_import),                                      # binding not installed
    ("auto", lambda: FakeNvml(init_error=FakeNvmlError("Driver Not Loaded"))),  # no driver
])
def test_absent_nvml_gives_no_reader(setting: str, load: Any, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="poolgate.agent.gpus"):
        assert open_gpus(setting, load) is None
    assert len(caplog.records) == 1


SAMPLES = {s.index: s for s in (
    GpuSample(0, "GPU-aaaa", 1000.0, 600.0, 400.0, 0.2),
    GpuSample(1, "GPU-bbbb", 1000.0, 100.0, 900.0, 0.6),
)}


@pytest.mark.parametrize(("devices", "expected"), [
    ((0,), (1000.0, 600.0, 0.2)),
    ((0, 1), (2000.0, 700.0, 0.4)),            # tensor parallel: memory adds up, utilisation averages
    (("1",), (1000.0, 100.0, 0.6)),
    (("GPU-bbbb",), (1000.0, 100.0, 0.6)),      # CUDA_VISIBLE_DEVICES may name GPUs by UUID
    ((), None),                                # no GPUs known for the worker (e.g. simulated)
    ((0, 7), None),                            # one of its GPUs was not read: do not report half
    (("GPU-zzzz",), None),
])
def test_summarize(devices: tuple[int | str, ...], expected: tuple[float, float, float] | None) -> None:
    summary = summarize(SAMPLES, devices)
    got = None if summary is None else (summary.memory_total_mib, summary.memory_free_mib, summary.utilization)
    assert got == (None if expected is None else pytest.approx(expected))


@pytest.mark.parametrize(("value", "expected"), [
    (None, ()), ("", ()), ("0", ("0",)), ("2, 3", ("2", "3")), ("GPU-aaaa,1,", ("GPU-aaaa", "1")),
])
def test_parse_visible_devices(value: str | None, expected: tuple[str, ...]) -> None:
    assert parse_visible_devices(value) == expected


def test_real_nvml_when_a_gpu_is_present() -> None:
    reader = open_gpus("auto")
    if reader is None or reader.count == 0:
        pytest.skip("no NVML driver or no GPU on this machine")
    try:
        samples = reader.read()
        assert set(samples) == set(range(reader.count))
        for sample in samples.values():
            assert sample.memory_total_mib > 0
            assert 0 <= sample.memory_free_mib <= sample.memory_total_mib
            assert 0.0 <= sample.utilization <= 1.0
            assert sample.uuid.startswith(("GPU-", "MIG-"))
        assert summarize(samples, [0]) is not None
    finally:
        reader.close()


def test_real_nvml_sees_memory_taken_and_a_busy_gpu_and_placement_follows() -> None:
    """On a GPU machine with PyTorch: what NVML reports moves with a real allocation and real work, and the
    controller's placement decides on those numbers."""
    torch = pytest.importorskip("torch")
    reader = open_gpus("auto")
    if reader is None or reader.count == 0 or not torch.cuda.is_available():
        pytest.skip("no NVML driver, GPU or CUDA PyTorch on this machine")
    try:
        torch.zeros(1, device="cuda:0")  # the CUDA context first: its own memory is not the allocation's
        torch.cuda.synchronize()
        before = reader.read()[0]
        block = torch.empty(8 * 1024 * MIB, dtype=torch.uint8, device="cuda:0")
        torch.cuda.synchronize()
        during = reader.read()[0]
        taken = before.memory_free_mib - during.memory_free_mib
        print(f"NVML: {before.memory_free_mib:.0f} MiB free, {during.memory_free_mib:.0f} after an 8192 MiB "
              f"allocation ({taken:.0f} MiB taken)")
        assert 8192 <= taken <= 8192 * 1.05

        gpus = {i: GpuFree(i, s.memory_total_mib, s.memory_free_mib) for i, s in reader.read().items()}
        assert place(during.memory_free_mib - 1024, 1, gpus).gpus == (0,)
        assert not place(during.memory_free_mib + 1024, 1, gpus).placed
        del block

        a = torch.randn(8192, 8192, device="cuda:0", dtype=torch.bfloat16)
        busiest = 0.0
        for _ in range(20):  # NVML's utilisation covers its last sample period: read it while kernels run
            for _ in range(50):
                a @ a
            torch.cuda.synchronize()
            busiest = max(busiest, reader.read()[0].utilization)
        print(f"NVML utilisation while multiplying matrices: {busiest:.0%}")
        assert busiest >= 0.5
    finally:
        reader.close()
