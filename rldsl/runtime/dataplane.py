"""The data plane: where sample tensors live between pipeline stages.

Workers put and get rows by sample key; the controller only passes keys.
Backends: ``TransferQueueDataPlane`` (TransferQueue on Ray; any Ray process
attaches; data moves worker to worker, one hop), ``RayActorDataPlane`` (an
in-memory store in one named Ray actor: no TransferQueue startup cost, but
two hops through that actor) and ``InMemoryDataPlane`` (a dict; one process).

Semantics, identical on every backend:
- ``put`` takes dense tensors, row i belonging to ``keys[i]``, and stores each
  row per key. Writing a field again replaces it; tags merge.
- ``get`` returns dense tensors, rows in the order of ``keys``. Rows of one
  field may differ in length (e.g. from puts padded to different widths):
  they are padded with 0 to the longest requested row, on the left for
  ``left_padded_fields`` (the prompt fields by default, so prompts stay
  aligned against their responses), else on the right. TransferQueue returns
  every non-scalar field as a jagged nested tensor even when it was put
  dense; ``get`` converts it back (``_dense_from_nested``).
- A missing key or field raises ``MissingDataError`` (TransferQueue itself
  silently drops missing keys and returns an empty batch for missing fields).
"""

from __future__ import annotations

import abc
import inspect
import os
from typing import Any, Iterable, Mapping, Sequence

from rldsl.runtime.protocols import FIELD_PROMPT_IDS, FIELD_PROMPT_MASK

DEFAULT_LEFT_PADDED_FIELDS = frozenset({FIELD_PROMPT_IDS, FIELD_PROMPT_MASK})

# TransferQueue registers its controller under this fixed name and namespace.
_TQ_CONTROLLER_NAME = "TransferQueueController"
_TQ_NAMESPACE = "transfer_queue"
_RAY_STORE_NAMESPACE = "rldsl"


def sample_key(pipeline: str, prompt_index: int, sample_index: int) -> str:
    """The data-plane key of one sample, unique per (pipeline, prompt, sample)."""
    if not pipeline or "/" in pipeline:
        raise ValueError(f"pipeline name must be non-empty and contain no '/': {pipeline!r}")
    if prompt_index < 0 or sample_index < 0:
        raise ValueError(f"indices must be >= 0, got prompt {prompt_index}, sample {sample_index}")
    return f"{pipeline}/p{prompt_index}/s{sample_index}"


def parse_sample_key(key: str) -> tuple[str, int, int]:
    """Inverse of ``sample_key``: (pipeline, prompt_index, sample_index)."""
    try:
        pipeline, prompt, sample = key.split("/")
        if not (prompt.startswith("p") and sample.startswith("s")):
            raise ValueError
        return pipeline, int(prompt[1:]), int(sample[1:])
    except ValueError:
        raise ValueError(f"not a sample key: {key!r}") from None


class MissingDataError(KeyError):
    """Requested keys or fields are not in the partition."""

    def __init__(self, partition: str, missing_keys: Sequence[str] = (), missing_fields: Sequence[str] = ()):
        super().__init__(partition, list(missing_keys), list(missing_fields))
        self.partition, self.missing_keys, self.missing_fields = self.args

    def __str__(self) -> str:
        if self.missing_keys:
            shown = ", ".join(self.missing_keys[:5]) + (" ..." if len(self.missing_keys) > 5 else "")
            return f"{len(self.missing_keys)} key(s) not in partition {self.partition!r}: {shown}"
        return f"field(s) {self.missing_fields} not written for every requested key in partition {self.partition!r}"


class DataPlane(abc.ABC):
    """Client of the data plane. See the module docstring for the semantics."""

    backend = ""  # the name connect_dataplane knows this class by

    def __init__(self, left_padded_fields: Iterable[str] = DEFAULT_LEFT_PADDED_FIELDS):
        self.left_padded_fields = frozenset(left_padded_fields)

    @property
    def spec(self) -> dict:
        """A small serialisable dict; ``connect_dataplane(spec)`` in another
        process (e.g. a Ray actor) returns a client of the same store."""
        return {"backend": self.backend, **self._options(), "left_padded_fields": sorted(self.left_padded_fields)}

    def _options(self) -> dict:
        return {}

    @abc.abstractmethod
    def put(self, keys: list[str], partition: str, fields: Mapping[str, Any], tags: list[dict] | None = None) -> None:
        """Store ``fields`` (dense tensors, row i belongs to ``keys[i]``) and
        merge ``tags`` (one dict per key). ``fields`` may be empty to only tag."""

    @abc.abstractmethod
    def get(self, keys: list[str], partition: str, fields: list[str]) -> dict[str, Any]:
        """Dense padded tensors, rows in the order of ``keys``."""

    @abc.abstractmethod
    def list_tags(self, partition: str) -> dict[str, dict]:
        """Every key present in ``partition`` with its merged tags."""

    def list(self, partition: str) -> list[str]:
        """The keys present in ``partition`` (an unknown partition is empty)."""
        return list(self.list_tags(partition))

    @abc.abstractmethod
    def clear(self, keys: list[str], partition: str) -> None:
        """Drop ``keys`` and their data; absent keys are ignored."""

    def close(self) -> None:
        """Release this client (the owner of a shared store also stops it)."""

    def __enter__(self) -> DataPlane:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


# ---------------------------------------------------------------- validation


def _check_keys(keys: Sequence[str]) -> list[str]:
    keys = list(keys)
    if not all(isinstance(k, str) for k in keys):
        raise TypeError("keys must be strings")
    if len(set(keys)) != len(keys):
        raise ValueError("keys must be unique within one call")
    return keys


def _check_put(keys: Sequence[str], fields: Mapping[str, Any], tags: list[dict] | None) -> list[str]:
    import torch

    keys = _check_keys(keys)
    for name, tensor in fields.items():
        if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
            raise TypeError(f"field {name!r} must be a tensor with one row per key")
        if tensor.shape[0] != len(keys):
            raise ValueError(f"field {name!r} has {tensor.shape[0]} rows for {len(keys)} keys")
    if tags is not None and len(tags) != len(keys):
        raise ValueError(f"{len(tags)} tags for {len(keys)} keys")
    return keys


def _check_get(keys: Sequence[str], fields: Sequence[str]) -> list[str]:
    keys = _check_keys(keys)
    if not keys or not fields:
        raise ValueError("get needs at least one key and one field")
    return keys


# ----------------------------------------------------------------- padding


def _pad_rows(rows: list, pad_left: bool):
    """Dense [n, longest, ...] from rows of different lengths, padded with 0.
    One allocation: on a busy machine fresh memory dominates the cost."""
    import torch

    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_side="left" if pad_left else "right")


def _dense_from_nested(tensor, pad_left: bool):
    """TransferQueue's jagged nested tensor back to a dense one.

    Equal-length rows (the common case: all from one put) are a zero-copy
    view of the packed values; ragged rows are padded."""
    if not tensor.is_nested:
        return tensor  # one scalar per row comes back dense
    offsets = tensor.offsets().tolist()
    width = offsets[1] - offsets[0] if len(offsets) > 1 else 0
    packed = tensor.lengths() is None  # no holes between rows
    if packed and all(end - start == width for start, end in zip(offsets, offsets[1:])):
        values = tensor.values()[offsets[0] : offsets[-1]]
        return values.view(len(offsets) - 1, width, *values.shape[1:])
    if not pad_left:
        return tensor.to_padded_tensor(0)
    return _pad_rows(list(tensor.unbind()), pad_left)


def _stack_rows(rows: list, pad_left: bool):
    """Dense tensor from per-key rows (the in-memory backend's get)."""
    import torch

    if all(r.shape == rows[0].shape for r in rows):
        return torch.stack(rows)
    return _pad_rows(rows, pad_left)


# --------------------------------------------------------------- in memory


class InMemoryDataPlane(DataPlane):
    """A dict of partitions. Rows are copied on put (callers may reuse their
    buffers); each put's copy stays alive until all of its rows are cleared."""

    backend = "memory"

    def __init__(self, left_padded_fields: Iterable[str] = DEFAULT_LEFT_PADDED_FIELDS):
        super().__init__(left_padded_fields)
        self._rows: dict[str, dict[str, dict[str, Any]]] = {}  # partition -> key -> field -> row
        self._tags: dict[str, dict[str, dict]] = {}  # partition -> key -> tags

    def put(self, keys, partition, fields, tags=None):
        keys = _check_put(keys, fields, tags)
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
        keys = _check_get(keys, fields)
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


# ----------------------------------------------------------- TransferQueue


def transferqueue_env() -> dict[str, str]:
    """Environment for every process that imports transfer_queue.

    TransferQueue sizes its torch thread pool from TQ_NUM_THREADS (default 8,
    read at import) and logs a warning on every put and get when that exceeds
    the physical cores; pinning it to the core count silences that without
    changing behaviour."""
    import psutil

    cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    return {"TQ_NUM_THREADS": os.environ.get("TQ_NUM_THREADS", str(min(8, cores)))}


def _import_transferqueue():
    import ray

    if not ray.is_initialized():
        raise RuntimeError("the TransferQueue data plane needs Ray: call rldsl.runtime.cluster.start_ray() first")
    for name, value in transferqueue_env().items():
        os.environ.setdefault(name, value)
    import transfer_queue

    return ray, transfer_queue


def _transferqueue_running(ray) -> bool:
    try:
        ray.get_actor(_TQ_CONTROLLER_NAME, namespace=_TQ_NAMESPACE)
        return True
    except ValueError:
        return False


def _check_cpus_for_transferqueue(ray, storage_units: int) -> None:
    """tq.init blocks forever if its actors (1 CPU each) cannot be placed."""
    needed = 1 + storage_units
    available = ray.available_resources().get("CPU", 0.0)
    if available < needed:
        raise RuntimeError(
            f"TransferQueue needs {needed} free logical CPUs (controller + {storage_units} storage "
            f"unit(s), 1 CPU each) but Ray has {available:g} available "
            f"(total {ray.cluster_resources().get('CPU', 0):g}). Start Ray with more logical CPUs "
            "(rldsl.runtime.cluster.start_ray does) or use fewer storage units."
        )


def _forget_previous_session(tq) -> None:
    """Drop TransferQueue state left by an earlier Ray session in this process
    (an owner that never closed). 0.1.11 keeps stale handles in module globals
    and then fails every later init, so reset them by hand."""
    state = tq.interface
    if any(getattr(state, name, None) is not None for name in ("_TQ_CLIENT", "_TQ_CONTROLLER", "_TQ_STORAGE")):
        try:
            tq.close()
        except Exception:  # the handles point into a cluster that is gone
            pass
        state._TQ_CLIENT = state._TQ_CONTROLLER = state._TQ_STORAGE = None


class TransferQueueDataPlane(DataPlane):
    """TransferQueue's SimpleStorage. The first process to construct one
    starts the controller and ``storage_units`` storage actors (it is the
    owner; its ``close`` stops them); later ones, in any process of the same
    Ray cluster, attach to that controller.

    TransferQueue keeps its client in module globals: one store per process.
    After every put and get it also resets torch's thread count to the value
    it had when transfer_queue was first imported in the process."""

    backend = "transferqueue"

    def __init__(self, storage_units: int = 1, left_padded_fields: Iterable[str] = DEFAULT_LEFT_PADDED_FIELDS):
        super().__init__(left_padded_fields)
        ray, tq = _import_transferqueue()
        self._tq = tq
        self.storage_units = storage_units
        self.owner = not _transferqueue_running(ray)
        if self.owner:
            _check_cpus_for_transferqueue(ray, storage_units)
            _forget_previous_session(tq)
        # tq.init attaches when a controller exists (the config is then ignored).
        storage = {"num_data_storage_units": storage_units}
        tq.init({"backend": {"storage_backend": "SimpleStorage", "SimpleStorage": storage}})
        self._closed = False

    def _options(self) -> dict:
        return {"storage_units": self.storage_units}

    def put(self, keys, partition, fields, tags=None):
        keys = _check_put(keys, fields, tags)
        if not keys or (not fields and tags is None):
            return
        from tensordict import TensorDict

        batch = TensorDict(dict(fields), batch_size=[len(keys)]) if fields else None
        self._tq.kv_batch_put(keys=keys, partition_id=partition, fields=batch, tags=tags)

    def get(self, keys, partition, fields):
        keys = _check_get(keys, fields)
        fields = list(fields)
        batch = self._fetch(keys, partition, fields)
        if batch is None:
            raise self._diagnose_missing(keys, partition, fields)
        return {f: _dense_from_nested(batch[f], f in self.left_padded_fields) for f in fields}

    def _fetch(self, keys, partition, fields):
        """The TensorDict if every key has every field, else None."""
        try:
            batch = self._tq.kv_batch_get(keys=keys, partition_id=partition, select_fields=fields)
        except ValueError:  # "keys or partition were not found!"
            return None
        if batch.batch_size[0] != len(keys) or any(f not in batch.keys() for f in fields):
            return None
        return batch

    def _diagnose_missing(self, keys, partition, fields) -> MissingDataError:
        present = set(self.list(partition))
        missing_keys = [k for k in keys if k not in present]
        if missing_keys:
            return MissingDataError(partition, missing_keys=missing_keys)
        missing_fields = [f for f in fields if self._fetch(keys, partition, [f]) is None]
        return MissingDataError(partition, missing_fields=missing_fields or fields)

    def list_tags(self, partition):
        return dict(self._tq.kv_list(partition_id=partition).get(partition, {}))

    def clear(self, keys, partition):
        keys = _check_keys(keys)
        if keys:
            self._tq.kv_clear(keys=keys, partition_id=partition)

    def close(self):
        # Only the owner calls tq.close(): in an attached process it would
        # kill the shared controller, which every other process still uses.
        if self.owner and not self._closed:
            self._tq.close()
        self._closed = True


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


# ------------------------------------------------------------------ connect


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
