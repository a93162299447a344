"""The data plane: where sample tensors live between pipeline stages.

Workers put and get rows by sample key; the controller only passes keys.
Backends: ``TransferQueueDataPlane`` (TransferQueue on Ray; any Ray process
attaches; data moves worker to worker, one hop), ``RayActorDataPlane`` (an
in-memory store in one named Ray actor: no TransferQueue startup cost, but
two hops through that actor) and ``InMemoryDataPlane`` (a dict; one process).

This module is the entry point: it picks a backend from a spec
(``connect_dataplane``) and re-exports the public names, so callers import
everything from here. The contract and its semantics, identical on every
backend, are in ``dataplane_base``; the backends in ``dataplane_memory``
(in memory and Ray actor) and ``dataplane_transferqueue``.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping

from rldsl.runtime.dataplane.base import (
    DEFAULT_LEFT_PADDED_FIELDS,
    DataPlane,
    DataPlaneUnavailable,
    MissingDataError,
    parse_sample_key,
    sample_key,
)
from rldsl.runtime.dataplane.memory import InMemoryDataPlane, RayActorDataPlane
from rldsl.runtime.dataplane.transferqueue import TransferQueueDataPlane, transferqueue_env

__all__ = [
    "DEFAULT_LEFT_PADDED_FIELDS",
    "DataPlane",
    "DataPlaneUnavailable",
    "InMemoryDataPlane",
    "MissingDataError",
    "RayActorDataPlane",
    "TransferQueueDataPlane",
    "connect_dataplane",
    "parse_sample_key",
    "sample_key",
    "transferqueue_env",
]


def connect_dataplane(spec: Mapping[str, Any]) -> DataPlane:
    """A data-plane client from a serialisable spec (pass ``plane.spec`` to
    Ray actors). Specs: {"backend": "transferqueue", "storage_units": 1},
    {"backend": "ray", "name": "rldsl-dataplane"}, {"backend": "memory"}
    (a fresh store private to this process), each with an optional
    "left_padded_fields" list."""
    options = dict(spec)
    backend = options.pop("backend", None)
    if backend not in _BACKENDS:
        raise ValueError(f"unknown data-plane backend {backend!r} (expected one of {sorted(_BACKENDS)})")
    plane_class = _BACKENDS[backend]
    accepted = set(inspect.signature(plane_class.__init__).parameters) - {"self"}
    unknown = set(options) - accepted
    if unknown:
        raise ValueError(f"unknown option(s) {sorted(unknown)} for backend {backend!r}; accepted: {sorted(accepted)}")
    return plane_class(**options)


_BACKENDS = {plane.backend: plane for plane in (TransferQueueDataPlane, RayActorDataPlane, InMemoryDataPlane)}
