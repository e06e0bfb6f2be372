"""Versioned snapshots of xDS resources, one per type URL. Holds data only; it never talks to Envoy.

A version is a hash of the content, so rebuilding an unchanged fleet yields the same version and nothing is
pushed. Versions are compared for equality only; they carry no order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from google.protobuf.message import Message

VERSION_CHARS = 16


def resource_name(resource: Message) -> str:
    """The xDS name of a resource: ``name`` for clusters, ``cluster_name`` for load assignments."""
    for field_name in ("name", "cluster_name"):
        value = getattr(resource, field_name, None)
        if isinstance(value, str) and value:
            return value
    raise ValueError(f"{type(resource).__name__} has no resource name")


def content_version(resources: Mapping[str, Message]) -> str:
    digest = hashlib.sha256()
    for name in sorted(resources):
        payload = resources[name].SerializeToString(deterministic=True)
        digest.update(f"{name}\0{len(payload)}\0".encode())
        digest.update(payload)
    return digest.hexdigest()[:VERSION_CHARS]


@dataclass(frozen=True)
class Snapshot:
    """All resources of one type URL at one version."""

    type_url: str
    version: str
    resources: Mapping[str, Message] = field(default_factory=dict)

    @classmethod
    def of(cls, type_url: str, resources: Sequence[Message]) -> Snapshot:
        by_name = {resource_name(r): r for r in resources}
        if len(by_name) != len(resources):
            raise ValueError(f"{type_url}: two resources share a name")
        return cls(type_url, content_version(by_name), MappingProxyType(by_name))

    def select(self, names: frozenset[str] | None) -> list[Message]:
        """The resources a subscriber asked for, sorted by name; ``None`` means all (wildcard)."""
        wanted = sorted(self.resources) if names is None else sorted(n for n in names if n in self.resources)
        return [self.resources[n] for n in wanted]


class SnapshotCache:
    """The latest snapshot per type URL; ``set`` reports which type URLs changed."""

    def __init__(self) -> None:
        self._snapshots: dict[str, Snapshot] = {}

    def set(self, snapshots: Sequence[Snapshot]) -> list[str]:
        changed: list[str] = []
        for snapshot in snapshots:
            current = self._snapshots.get(snapshot.type_url)
            if current is None or current.version != snapshot.version:
                self._snapshots[snapshot.type_url] = snapshot
                changed.append(snapshot.type_url)
        return changed

    def get(self, type_url: str) -> Snapshot | None:
        return self._snapshots.get(type_url)

    def version(self) -> str:
        """One version for everything cached: changes when any type's version changes."""
        digest = hashlib.sha256()
        for type_url in sorted(self._snapshots):
            digest.update(f"{type_url}={self._snapshots[type_url].version};".encode())
        return digest.hexdigest()[:VERSION_CHARS]
