"""One exception tree: every exception poolgate defines derives from ``PoolgateError``, found by importing every
module of the project's packages, so a new one cannot escape it; and the kinds callers catch by hold."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Iterator

import pytest

from agent.agent import ScrapeError
from agent.gpu_sources.polled import GpuSourceError
from agent.podresources import PodResourcesError
from agent.vllm_metrics import MetricsFormatError
from controller.backend import PlacementRefused
from controller.instances import NotLeader
from controller.lean_front import BadRequest
from extproc.kvcache.wire import KVEventDecodeError
from poolgate.kernel.config import ConfigError
from poolgate.kernel.errors import PoolgateError, Refused, UpstreamError
from poolgate.kernel.lean_http import AnswerTooLarge, PeerClosed
from simworker.kv_transfer import TransferParamsError
from simworker.protocol import WorkerApiError

PACKAGES = ("poolgate", "extproc", "controller", "agent", "simworker", "bench")


def _classes_of(owner: object, module: str) -> Iterator[type]:
    """The classes ``owner`` (a module or a class) defines itself, and the classes nested in them."""
    for value in vars(owner).values():
        if inspect.isclass(value) and value.__module__ == module and value is not owner:
            yield value
            yield from _classes_of(value, module)


def project_exceptions() -> dict[str, type[BaseException]]:
    """Every exception class the packages define, by dotted name; a module that does not import is an error."""
    found: dict[str, type[BaseException]] = {}
    for top in PACKAGES:
        package = importlib.import_module(top)
        names = [top, *(info.name for info in pkgutil.walk_packages(package.__path__, f"{top}."))]
        for name in names:
            module = importlib.import_module(name)
            for cls in _classes_of(module, name):
                if issubclass(cls, BaseException):
                    found[f"{name}.{cls.__qualname__}"] = cls
    return found


def test_the_walk_sees_the_packages_exceptions() -> None:
    # A walk that found nothing would pass the next test for nothing.
    found = project_exceptions().values()
    assert {ConfigError, WorkerApiError, KVEventDecodeError, BadRequest, ScrapeError} <= set(found)


def test_every_exception_derives_from_poolgate_error() -> None:
    outside = sorted(name for name, cls in project_exceptions().items() if not issubclass(cls, PoolgateError))
    assert not outside, f"derive these from PoolgateError (or a branch of it in poolgate.kernel.errors): {outside}"


@pytest.mark.parametrize(("error", "kind"), [
    (ScrapeError, UpstreamError),
    (MetricsFormatError, UpstreamError),
    (PodResourcesError, UpstreamError),
    (GpuSourceError, UpstreamError),
    (KVEventDecodeError, UpstreamError),
    (AnswerTooLarge, UpstreamError),
    (PeerClosed, UpstreamError),
    (BadRequest, Refused),
    (TransferParamsError, Refused),
    (PlacementRefused, Refused),
    (NotLeader, Refused),
])
def test_each_error_is_of_its_kind(error: type[PoolgateError], kind: type[PoolgateError]) -> None:
    assert issubclass(error, kind)


@pytest.mark.parametrize(("error", "builtin"), [
    (MetricsFormatError, ValueError),
    (KVEventDecodeError, ValueError),
    (AnswerTooLarge, ValueError),
    (PeerClosed, ConnectionResetError),
    (BadRequest, ValueError),
    (TransferParamsError, ValueError),
])
def test_a_branch_keeps_the_builtin_base_callers_catch(error: type[PoolgateError], builtin: type[Exception]) -> None:
    # Callers catch these as the built-in too (a ValueError from a parser, an OSError from a connection).
    assert issubclass(error, builtin)


def test_the_branches_are_apart() -> None:
    assert not issubclass(UpstreamError, Refused) and not issubclass(Refused, UpstreamError)
    assert not issubclass(ConfigError, UpstreamError | Refused)
