"""extproc: Envoy's external processor. Per request: parse, admit, pick a pool and worker, answer Envoy.

It never does I/O inside the pick: decisions are pure functions over an in-memory fleet snapshot.
"""
