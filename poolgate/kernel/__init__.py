"""The kernel every poolgate program imports: configuration, the fleet schema in Redis, logging, shutdown.

It imports nothing from ``extproc``, ``controller``, ``agent``, ``simworker`` or the application layer
(``poolgate.cli`` and friends), so any program can use it without pulling in the others.
"""
