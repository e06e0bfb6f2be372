"""A stand-in for NVIDIA's dcgm-exporter on a GPU node these tests do not have.

It serves ``/metrics`` in dcgm-exporter's format (the families and label set of its default counters, as
in ``tests/fixtures/dcgm-exporter-two-gpus.txt``) for GPUs whose memory and utilisation the test sets.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web

from poolgate.procs import free_port


@dataclass
class StandInGpu:
    index: int
    uuid: str
    free_mib: float
    used_mib: float
    utilization_percent: float
    pods: list[tuple[str, str]] = field(default_factory=list)
    """(namespace, pod) holding this GPU, as the exporter's Kubernetes mapping labels it."""


FAMILIES = (
    ("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz).", lambda gpu: "1980"),
    ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", lambda gpu: f"{gpu.utilization_percent:g}"),
    ("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", lambda gpu: f"{gpu.free_mib:g}"),
    ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", lambda gpu: f"{gpu.used_mib:g}"),
    ("DCGM_FI_DEV_FB_RESERVED", "Framebuffer memory reserved (in MiB).", lambda gpu: "512"),
)


def dcgm_page(hostname: str, gpus: list[StandInGpu]) -> str:
    lines = []
    for name, help_text, value in FAMILIES:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
        for gpu in gpus:
            base = (f'gpu="{gpu.index}",UUID="{gpu.uuid}",pci_bus_id="00000000:{0x18 + gpu.index:02X}:00.0",'
                    f'device="nvidia{gpu.index}",modelName="NVIDIA H100 80GB HBM3",Hostname="{hostname}",'
                    f'DCGM_FI_DRIVER_VERSION="570.124.06"')
            holders = [f',container="main",namespace="{ns}",pod="{pod}",pod_uid=""' for ns, pod in gpu.pods]
            lines += [f"{name}{{{base}{holder}}} {value(gpu)}" for holder in holders or [""]]
    return "\n".join(lines) + "\n"


class StandInDcgmExporter:
    """``GET /metrics`` on a free port of 127.0.0.1 with the current ``gpus``; counts the scrapes."""

    def __init__(self, hostname: str, gpus: list[StandInGpu]) -> None:
        self.hostname = hostname
        self.gpus = gpus
        self.port = free_port()
        self.scrapes = 0
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _metrics(self, _: web.Request) -> web.Response:
        self.scrapes += 1
        return web.Response(text=dcgm_page(self.hostname, self.gpus), content_type="text/plain")
