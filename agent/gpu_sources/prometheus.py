"""A Prometheus server that scrapes dcgm-exporter: one instant query per read for every GPU of the fleet.

The query asks for the series a reading needs and nothing else, narrowed by the configured label matchers::

    {__name__=~"DCGM_FI_DEV_FB_FREE|…", <selector>}

and its ``vector`` result goes through the same series → reading step as an exporter's page, with each
GPU filed under its node (``node_label``, dcgm-exporter's ``Hostname`` by default).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import orjson

from agent.gpu_sources.dcgm_series import GPU_FIELDS, Series, reading_from_series
from agent.gpu_sources.polled import GpuSourceError, HttpText
from agent.gpu_sources.reading import GpuReading

QUERY_PATH = "/api/v1/query"


def gpu_query(selector: str = "") -> str:
    extra = selector.strip().rstrip(",")
    matchers = [f'__name__=~"{"|".join(GPU_FIELDS)}"', *([extra] if extra else [])]
    return "{" + ", ".join(matchers) + "}"


def parse_query_reply(body: str | bytes, node_label: str) -> GpuReading:
    """A ``/api/v1/query`` answer as a reading of the fleet; raises ``GpuSourceError`` on an error answer
    or one that is not an instant vector."""
    try:
        reply = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise GpuSourceError(f"answer is not JSON: {exc}") from exc
    if not isinstance(reply, dict) or reply.get("status") != "success":
        detail = reply.get("error", reply) if isinstance(reply, dict) else reply
        raise GpuSourceError(f"query failed: {detail}")
    data = reply.get("data")
    if not isinstance(data, dict) or data.get("resultType") != "vector" or not isinstance(data.get("result"), list):
        raise GpuSourceError("answer is not an instant vector")
    return reading_from_series(_series(data["result"]), node_label=node_label)


def _series(result: list[Any]) -> Iterator[Series]:
    for item in result:
        try:
            labels: Mapping[str, str] = item["metric"]
            value = float(item["value"][1])
        except (KeyError, IndexError, TypeError, ValueError):
            continue  # not a sample; the rest of the answer is still good
        yield Series(labels.get("__name__", ""), labels, value)


class PrometheusReader:
    """One ``GET /api/v1/query`` per read."""

    def __init__(self, http: HttpText, url: str, selector: str, node_label: str) -> None:
        self._http = http
        self.url = url.rstrip("/") + QUERY_PATH
        self.query = gpu_query(selector)
        self._node_label = node_label

    async def read_once(self) -> GpuReading:
        status, body = await self._http.get(self.url, params={"query": self.query})
        if status != 200:  # Prometheus says why in a JSON body (400 bad query, 422 cannot run, 503 busy)
            raise GpuSourceError(f"{self.url} answered HTTP {status}: {_error_of(body)}")
        return parse_query_reply(body, self._node_label)


def _error_of(body: str) -> str:
    try:
        reply = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body[:200]
    return str(reply.get("error", "")) if isinstance(reply, dict) else ""
