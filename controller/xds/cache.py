"""Versioned snapshots of xDS resources, one per type URL. Holds data only; it never talks to Envoy.

A version is a hash of the content, so rebuilding an unchanged fleet yields the same version and nothing is
pushed. Each resource has its own version too, so a stream can send an Envoy only the load assignments
that changed (EDS answers need not repeat the others), and a snapshot with a few resources replaced
(``replaced``) costs the size of those, not of the fleet. Versions are compared for equality only; they
carry no order.

A snapshot holds each resource in wire form, the bytes a stream sends as they are: a load assignment joined
from its endpoints' bytes (``Encoded``) is never parsed back, and no resource is serialized again for its
version or for each Envoy. At 10,000 workers the fallback's assignment was parsed once and serialized three
times more on its way to two Envoys, on the controller's loop, every time it was sent.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from google.protobuf import descriptor_pool, message_factory
from google.protobuf.message import Message

VERSION_CHARS = 16


@dataclass(frozen=True)
class Encoded:
    """A resource already in wire form (serialized deterministically): ``wire`` is sent as it is."""

    name: str
    wire: bytes


def resource_name(resource: Message | Encoded) -> str:
    """The xDS name of a resource: ``name`` for clusters, ``cluster_name`` for load assignments."""
    if isinstance(resource, Encoded):
        return resource.name
    for field_name in ("name", "cluster_name"):
        value = getattr(resource, field_name, None)
        if isinstance(value, str) and value:
            return value
    raise ValueError(f"{type(resource).__name__} has no resource name")


def wire_of(resource: Message | Encoded) -> bytes:
    return resource.wire if isinstance(resource, Encoded) else resource.SerializeToString(deterministic=True)


def resource_version(wire: bytes) -> str:
    return hashlib.sha256(wire).hexdigest()[:VERSION_CHARS]


def combined_version(versions: Mapping[str, str]) -> str:
    """One version for a set of resources, from theirs (cheap: no resource is serialized again)."""
    digest = hashlib.sha256()
    for name in sorted(versions):
        digest.update(f"{name}\0{versions[name]}\0".encode())
    return digest.hexdigest()[:VERSION_CHARS]


def message_class(type_url: str) -> type[Message]:
    """The message class a type URL names (``type.googleapis.com/<full name>``)."""
    descriptor = descriptor_pool.Default().FindMessageTypeByName(type_url.rpartition("/")[2])
    return message_factory.GetMessageClass(descriptor)


class ParsedResources(Mapping[str, Message]):
    """A snapshot's resources as messages, each parsed from its wire form when read (for tests and tools: the
    streams send the wire form)."""

    def __init__(self, wires: Mapping[str, bytes], kind: type[Message]) -> None:
        self._wires = wires
        self._kind = kind

    def __getitem__(self, name: str) -> Message:
        return self._kind.FromString(self._wires[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._wires)

    def __len__(self) -> int:
        return len(self._wires)


@dataclass(frozen=True)
class Snapshot:
    """All resources of one type URL at one version."""

    type_url: str
    version: str
    wires: Mapping[str, bytes] = field(default_factory=dict)
    """Resource name → the resource in wire form."""
    versions: Mapping[str, str] = field(default_factory=dict)
    """Resource name → its own content version."""

    @classmethod
    def of(cls, type_url: str, resources: Sequence[Message | Encoded]) -> Snapshot:
        wires = {resource_name(r): wire_of(r) for r in resources}
        if len(wires) != len(resources):
            raise ValueError(f"{type_url}: two resources share a name")
        versions = {name: resource_version(wire) for name, wire in wires.items()}
        return cls(type_url, combined_version(versions), MappingProxyType(wires), MappingProxyType(versions))

    def replaced(self, resources: Sequence[Message | Encoded]) -> Snapshot:
        """This snapshot with ``resources`` added or replaced (by name); only those are hashed."""
        wires = dict(self.wires)
        versions = dict(self.versions)
        for resource in resources:
            name = resource_name(resource)
            wires[name] = wire_of(resource)
            versions[name] = resource_version(wires[name])
        return Snapshot(self.type_url, combined_version(versions), MappingProxyType(wires),
                        MappingProxyType(versions))

    @property
    def resources(self) -> Mapping[str, Message]:
        return ParsedResources(self.wires, message_class(self.type_url))

    def select(self, names: frozenset[str] | None) -> list[Message]:
        """The resources a subscriber asked for, sorted by name, as messages; ``None`` means all (wildcard)."""
        resources = self.resources
        return [resources[n] for n in self.selected_names(names)]

    def selected_names(self, names: frozenset[str] | None) -> list[str]:
        return sorted(self.wires) if names is None else sorted(n for n in names if n in self.wires)


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
