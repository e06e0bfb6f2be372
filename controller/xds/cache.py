"""Versioned snapshots of xDS resources, one per type URL. Holds data only; it never talks to Envoy.

A version is a hash of the content, so rebuilding an unchanged fleet yields the same version and nothing is
pushed. Each resource has its own version too, so a stream can send an Envoy only the load assignments
that changed (EDS answers need not repeat the others), and a snapshot with a few resources replaced
(``replaced``) costs the size of those, not of the fleet. Versions are compared for equality only; they
carry no order.
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


def resource_version(resource: Message) -> str:
    return hashlib.sha256(resource.SerializeToString(deterministic=True)).hexdigest()[:VERSION_CHARS]


def combined_version(versions: Mapping[str, str]) -> str:
    """One version for a set of resources, from theirs (cheap: no resource is serialized again)."""
    digest = hashlib.sha256()
    for name in sorted(versions):
        digest.update(f"{name}\0{versions[name]}\0".encode())
    return digest.hexdigest()[:VERSION_CHARS]


def content_version(resources: Mapping[str, Message]) -> str:
    return combined_version({name: resource_version(resource) for name, resource in resources.items()})


@dataclass(frozen=True)
class Snapshot:
    """All resources of one type URL at one version."""

    type_url: str
    version: str
    resources: Mapping[str, Message] = field(default_factory=dict)
    versions: Mapping[str, str] = field(default_factory=dict)
    """Resource name → its own content version."""

    @classmethod
    def of(cls, type_url: str, resources: Sequence[Message]) -> Snapshot:
        by_name = {resource_name(r): r for r in resources}
        if len(by_name) != len(resources):
            raise ValueError(f"{type_url}: two resources share a name")
        versions = {name: resource_version(r) for name, r in by_name.items()}
        return cls(type_url, combined_version(versions), MappingProxyType(by_name), MappingProxyType(versions))

    def replaced(self, resources: Sequence[Message]) -> Snapshot:
        """This snapshot with ``resources`` added or replaced (by name); only those are serialized."""
        by_name = dict(self.resources)
        versions = dict(self.versions)
        for resource in resources:
            name = resource_name(resource)
            by_name[name] = resource
            versions[name] = resource_version(resource)
        return Snapshot(self.type_url, combined_version(versions), MappingProxyType(by_name),
                        MappingProxyType(versions))

    def select(self, names: frozenset[str] | None) -> list[Message]:
        """The resources a subscriber asked for, sorted by name; ``None`` means all (wildcard)."""
        return [self.resources[n] for n in self.selected_names(names)]

    def selected_names(self, names: frozenset[str] | None) -> list[str]:
        return sorted(self.resources) if names is None else sorted(n for n in names if n in self.resources)


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
