"""controller: keeps the worker fleet (registry, health, xDS to Envoy, worker processes).

It is never in a request's path: Envoy and extproc keep serving on their last state while it is away.
"""
