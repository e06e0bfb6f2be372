"""One fault stack for the whole fault suite: each case breaks one piece, checks the rest, and leaves the
stack whole again for the next (starting a stack costs more than most cases)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.harness import FaultStack, fault_stack_fixture


@pytest.fixture(scope="package")
def fault_stack() -> Iterator[FaultStack]:
    yield from fault_stack_fixture(Path(tempfile.mkdtemp(prefix="poolgate-faults-")))
