"""A clock the test moves by hand: the code under test reads time only through the callable it is given."""

from __future__ import annotations


class ManualClock:
    """Returns ``now``; tests set or advance ``now`` themselves."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
