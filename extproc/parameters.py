"""A catalogue version's request parameters, applied to the parsed request body before it goes upstream.

Defaults fill only what the client left out (a ``max_tokens`` default also yields to a client's
``max_completion_tokens``); caps refuse a request with a 400 that names the parameter, its value and the
limit, rather than lowering it silently, so a client never gets a shorter answer than it asked for without
knowing why. The version's ``max_model_len`` caps the output tokens asked for the same way.
"""

from __future__ import annotations

from typing import Any, TypeGuard

from extproc.catalogue import Route
from extproc.errors import ApiError, invalid_request

_OUTPUT_LIMITS = ("max_tokens", "max_completion_tokens")
"""Two names for one limit: a cap or default on either applies to both."""


def apply_parameters(data: dict[str, Any], route: Route) -> ApiError | bool:
    """Fill ``route``'s defaults into ``data`` (in place) and check its caps; True when ``data`` changed."""
    changed = False
    for name, value in route.defaults.items():
        if data.get(name) is not None:
            continue
        if name in _OUTPUT_LIMITS and any(data.get(n) is not None for n in _OUTPUT_LIMITS):
            continue
        data[name] = value
        changed = True
    for name, cap in route.maximums.items():
        for asked in (_OUTPUT_LIMITS if name in _OUTPUT_LIMITS else (name,)):
            asked_value = data.get(asked)
            if _is_number(asked_value) and asked_value > cap:
                return _above(route, asked, asked_value, cap, name)
    if route.max_model_len is not None:
        for asked in _OUTPUT_LIMITS:
            asked_value = data.get(asked)
            if _is_number(asked_value) and asked_value > route.max_model_len:
                return _above(route, asked, asked_value, route.max_model_len, "max_model_len")
    return changed


def _is_number(value: Any) -> TypeGuard[float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _above(route: Route, asked: str, value: float, cap: float, limit: str) -> ApiError:
    shown = int(cap) if float(cap).is_integer() else cap
    return invalid_request(
        f"'{asked}' is {value}, above the limit of {shown} ({limit}) for model {route.public_name!r} "
        f"(version {route.version}).", asked, "parameter_above_limit")
