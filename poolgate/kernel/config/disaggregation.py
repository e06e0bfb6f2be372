"""Prefill/decode disaggregation: when a long prompt is split over a prefill and a decode pool, and where
the sidecar that runs the two steps listens."""

from __future__ import annotations

from pydantic import Field

from poolgate.kernel.config.base import Section


class DisaggregationSettings(Section):
    """Read by extproc (the threshold) and ``poolgate up`` (the sidecar); in force only for models that have a
    ``role: prefill`` pool."""

    min_prompt_tokens: int = Field(2048, ge=1)
    """Prompts of at least this many (estimated) tokens are prefilled on a prefill worker and decoded on a
    decode worker; shorter ones go straight to a decode-capable worker, where their prefill is short enough
    not to stall the streams decoding there (chosen by measurement: docs/disaggregation.md)."""
    sidecar_host: str = "127.0.0.1"
    sidecar_port: int = Field(0, ge=0, le=65535)
    """The sidecar Envoy sends split requests to (0: ``poolgate up`` picks a free port)."""
    step_timeout_s: float = Field(30.0, gt=0)
    """Longest wait for a prefill answer, or for a decode worker's first byte, before the next is tried."""
