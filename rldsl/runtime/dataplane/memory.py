"""The in-memory data-plane store, in this process or in one Ray actor.

``InMemoryDataPlane`` is a dict private to one process; ``RayActorDataPlane``
puts that same store inside a named Ray actor so every process of the cluster
shares it (no TransferQueue startup cost, but two hops through the actor).
"""

from __future__ import annotations

from typing import Any, Iterable

from rldsl.runtime.dataplane.base import (
    DEFAULT_LEFT_PADDED_FIELDS,
    DataPlane,
    MissingDataError,
    check_get,
    check_put,
    pad_rows,
)

_RAY_STORE_NAMESPACE = "rldsl"


def _stack_rows(rows: list, pad_left: bool):
    """Dense tensor from per-key rows (the in-memory backend's get)."""
    import torch

    if all(r.shape == rows[0].shape for r in rows):
        return torch.stack(rows)
    return pad_rows(rows, pad_left)


class InMemoryDataPlane(DataPlane):
    """A dict of partitions. Rows are copied on put (callers may reuse their
    buffers); each put's copy stays alive until all of its rows are cleared."""

    backend = "memory"

    def __init__(self, left_padded_fields: Iterable[str] = DEFAULT_LEFT_PADDED_FIELDS):
        super().__init__(left_padded_fields)
        self._rows: dict[str, dict[str, dict[str, Any]]] = {}  # partition -> key -> field -> row
        self._tags: dict[str, dict[str, dict]] = {}  # partition -> key -> tags

    def put(self, keys, partition, fields, tags=None):
        keys = check_put(keys, fields, tags)
        if not keys or (not fields and tags is None):
            return
        rows = self._rows.setdefault(partition, {})
        tag_table = self._tags.setdefault(partition, {})
        columns = {name: tensor.detach().clone().unbind(0) for name, tensor in fields.items()}
        for i, key in enumerate(keys):
            key_rows = rows.setdefault(key, {})
            for name, column in columns.items():
                key_rows[name] = column[i]
            tag_table.setdefault(key, {}).update(tags[i] if tags else {})

    def get(self, keys, partition, fields):
        keys = check_get(keys, fields)
        rows = self._rows.get(partition, {})
        missing_keys = [k for k in keys if k not in rows]
        if missing_keys:
            raise MissingDataError(partition, missing_keys=missing_keys)
        missing_fields = [f for f in fields if any(f not in rows[k] for k in keys)]
        if missing_fields:
            raise MissingDataError(partition, missing_fields=missing_fields)
        return {f: _stack_rows([rows[k][f] for k in keys], f in self.left_padded_fields) for f in fields}

    def list_tags(self, partition):
        return {key: dict(tags) for key, tags in self._tags.get(partition, {}).items()}

    def clear(self, keys, partition):
        for key in keys:
            self._rows.get(partition, {}).pop(key, None)
            self._tags.get(partition, {}).pop(key, None)

    def close(self):
        self._rows.clear()
        self._tags.clear()


# ------------------------------------------------------------ Ray actor store


def _store_actor_class(ray):
    @ray.remote(num_cpus=0)
    class DataPlaneStore:
        """An InMemoryDataPlane in its own actor. Errors come back as values
        so callers see a plain MissingDataError, not a wrapped RayTaskError."""

        def __init__(self, left_padded_fields):
            self._plane = InMemoryDataPlane(left_padded_fields)

        def call(self, method: str, *args):
            try:
                return True, getattr(self._plane, method)(*args)
            except (MissingDataError, ValueError, TypeError) as error:
                return False, error

    return DataPlaneStore


class RayActorDataPlane(DataPlane):
    """An ``InMemoryDataPlane`` inside a named Ray actor (namespace "rldsl"),
    shared by every process of the Ray cluster; its creator owns it and kills
    it on ``close``. One cheap actor, but all data passes through it."""

    backend = "ray"

    def __init__(self, name: str = "rldsl-dataplane", left_padded_fields: Iterable[str] = DEFAULT_LEFT_PADDED_FIELDS):
        super().__init__(left_padded_fields)
        import ray

        self._ray = ray
        self.name = name
        try:
            self._actor = ray.get_actor(name, namespace=_RAY_STORE_NAMESPACE)
            self.owner = False
        except ValueError:
            store = _store_actor_class(ray).options(name=name, namespace=_RAY_STORE_NAMESPACE)
            self._actor = store.remote(sorted(self.left_padded_fields))
            self.owner = True

    def _options(self) -> dict:
        return {"name": self.name}

    def service_actors(self) -> dict[str, object]:
        return {f"store actor {self.name}": self._actor}

    def _call(self, method: str, *args):
        ok, value = self._ray.get(self._actor.call.remote(method, *args))
        if not ok:
            raise value
        return value

    def put(self, keys, partition, fields, tags=None):
        self._call("put", list(keys), partition, dict(fields), tags)

    def get(self, keys, partition, fields):
        return self._call("get", list(keys), partition, list(fields))

    def list_tags(self, partition):
        return self._call("list_tags", partition)

    def clear(self, keys, partition):
        self._call("clear", list(keys), partition)

    def close(self):
        if self.owner and self._actor is not None:
            self._ray.kill(self._actor)
        self._actor = None
