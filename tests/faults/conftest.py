"""One fault stack for the whole fault suite: each case breaks one piece, checks the rest, and leaves the
stack whole again for the next (starting a stack costs more than most cases)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.faults.harness import FaultStack, fault_stack_fixture
from tests.run_dirs import run_directory


@pytest.fixture(scope="package")
def fault_stack() -> Iterator[FaultStack]:
    yield from fault_stack_fixture(run_directory("poolgate-faults-"))
