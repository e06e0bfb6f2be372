"""Learned output lengths: how long answers really are, per model and task class (and tenant with data).

Clients set a generous ``max_tokens`` or none, so reserving KV and decode room for the cap refuses work
that would fit: a chat answer of ~130 tokens reserved as 4,096. extproc reads the usage of a sample of the
responses it routes (``completion_tokens``) and keeps the last ``window`` lengths per (model, task class)
and per (model, task class, tenant). The expected output of a request becomes

    expected = min(q, max_tokens)   (q alone without max_tokens)

with q the ``quantile`` of the tenant's window once it holds ``tenant_min_samples``, else of the model and
class window once it holds ``min_samples``; until then the old rule (``max_tokens``, or the configured
default) stands. A length cut at ``max_tokens`` is a lower bound of the natural one; it enters as is, which
errs low only for requests that hit their cap, and those get at most their cap again.

Lengths come from every response whose usage extproc reads anyway (quota reconciliation, GenAI metrics) and,
with ``sample_every`` N > 0, from more: every response while a process has fewer than ``min_samples``
lengths in all, then one in N (reading a body costs CPU per streamed chunk).
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field, replace

from extproc.scheduling.plugins import PickRequest


@dataclass
class _Window:
    size: int
    lengths: deque[int] = field(default_factory=deque)
    ordered: list[int] = field(default_factory=list)

    def add(self, length: int) -> None:
        if len(self.lengths) == self.size:
            old = self.lengths.popleft()
            del self.ordered[bisect.bisect_left(self.ordered, old)]
        self.lengths.append(length)
        bisect.insort(self.ordered, length)

    def quantile(self, q: float) -> int:
        return self.ordered[min(len(self.ordered) - 1, int(q * len(self.ordered)))]


class OutputLengths:
    def __init__(self, quantile: float = 0.95, window: int = 1000, min_samples: int = 50,
                 tenant_min_samples: int = 200, sample_every: int = 0) -> None:
        if not 0 < quantile <= 1 or window < 1 or min_samples < 1 or sample_every < 0:
            raise ValueError("quantile in (0, 1], window and min_samples at least 1, sample_every 0 or more")
        self.quantile = quantile
        self.window = window
        self.min_samples = min_samples
        self.tenant_min_samples = tenant_min_samples
        self.sample_every = sample_every
        self._windows: dict[tuple[str, ...], _Window] = {}
        self._seen = 0
        self._asked = 0

    def wants_sample(self) -> bool:
        """Read this response's usage? Decided at the headers, before the model is known."""
        if not self.sample_every:
            return False
        self._asked += 1
        return self._seen < self.min_samples or self._asked % self.sample_every == 0

    def observe(self, model: str, task_class: str, tenant: str, output_tokens: int) -> None:
        if output_tokens <= 0:
            return
        self._seen += 1
        for key in ((model, task_class), (model, task_class, tenant)):
            window = self._windows.get(key)
            if window is None:
                window = self._windows[key] = _Window(self.window)
            window.add(output_tokens)

    def expected(self, model: str, task_class: str, tenant: str) -> int | None:
        for key, needed in (((model, task_class, tenant), self.tenant_min_samples), ((model, task_class),
                                                                                     self.min_samples)):
            window = self._windows.get(key)
            if window is not None and len(window.lengths) >= needed:
                return window.quantile(self.quantile)
        return None

    def refine(self, request: PickRequest, tenant: str) -> PickRequest:
        """The request with its expected output from the learned lengths (never above ``max_tokens``)."""
        learned = self.expected(request.model, request.task_class, tenant)
        if learned is None:
            return request
        cap = request.facts.max_tokens
        output = min(learned, cap) if cap else learned
        return request if output == request.output_tokens else replace(request, output_tokens=output)
