"""Messages of the kubelet's PodResources API (``v1``), compiled from ``podresources.proto``.

``podresources_pb2`` is generated code, checked in so that no build step needs a protobuf compiler; the
proto file says how to regenerate it. Only ``agent.podresources`` uses it; nothing here does I/O.
"""
