"""The TransferQueue data-plane backend, the one ``rldsl run`` uses.

TransferQueue runs on Ray and any Ray process attaches to it, so data moves
worker to worker in one hop. Everything TransferQueue-specific lives here:
its process environment, starting or attaching to its controller, and
converting its jagged nested tensors back to the dense rows the data-plane
contract (``dataplane_base``) promises, without importing ``torch._dynamo``.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
import types
from typing import Iterable

from rldsl.runtime.dataplane.base import (
    DEFAULT_LEFT_PADDED_FIELDS,
    DataPlane,
    DataPlaneUnavailable,
    MissingDataError,
    check_get,
    check_keys,
    check_put,
    pad_rows,
)

# TransferQueue registers its controller under this fixed name and namespace.
_TQ_CONTROLLER_NAME = "TransferQueueController"
_TQ_NAMESPACE = "transfer_queue"
_TQ_STORAGE_UNIT_PREFIX = "TransferQueueStorageUnit#"


def transferqueue_env() -> dict[str, str]:
    """Environment for every process that imports transfer_queue.

    TransferQueue sizes its torch thread pool from TQ_NUM_THREADS (default 8,
    read at import) and logs a warning on every put and get when that exceeds
    the physical cores; pinning it to the core count silences that without
    changing behaviour."""
    import psutil

    cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    return {"TQ_NUM_THREADS": os.environ.get("TQ_NUM_THREADS", str(min(8, cores)))}


def import_in_background() -> threading.Thread:
    """Start importing transfer_queue on a thread: it takes seconds (it pulls
    in torch and tensordict), time that can overlap Ray's start. A
    later import waits on Python's import lock for this one to finish."""
    for name, value in transferqueue_env().items():
        os.environ.setdefault(name, value)
    thread = threading.Thread(target=import_transferqueue_module, daemon=True, name="import transfer_queue")
    thread.start()
    return thread


def import_transferqueue_module():
    """``transfer_queue``, imported without importing ``torch._dynamo``.

    tensordict (which TransferQueue imports) marks a few of its functions for
    ``torch.compile`` at import through ``torch.compiler.allow_in_graph`` and
    ``assume_constant_result``, and each of those imports the whole of
    ``torch._dynamo``: about 1 s of CPU and 140 MB in every process that
    touches the data plane, for marks that only matter to a process compiling
    tensordict code, which no rldsl process does. The two are no-ops while
    tensordict imports (a compile would then trace those functions rather
    than keep them whole: slower, not wrong; another thread importing in that
    window loses its marks the same way). A process that already has
    ``torch._dynamo`` or tensordict imports as usual."""
    import sys

    import torch.compiler

    if "tensordict" in sys.modules or "torch._dynamo" in sys.modules:
        return importlib.import_module("transfer_queue")
    marks = torch.compiler.allow_in_graph, torch.compiler.assume_constant_result
    torch.compiler.allow_in_graph = torch.compiler.assume_constant_result = _unmarked
    try:
        return importlib.import_module("transfer_queue")
    finally:
        torch.compiler.allow_in_graph, torch.compiler.assume_constant_result = marks


def _unmarked(fn):
    return fn


def _import_transferqueue():
    import ray

    if not ray.is_initialized():
        raise RuntimeError("the TransferQueue data plane needs Ray: call rldsl.runtime.ray_lowering.cluster.start_ray() first")
    for name, value in transferqueue_env().items():
        os.environ.setdefault(name, value)
    return ray, import_transferqueue_module()


def _transferqueue_running(ray) -> bool:
    try:
        ray.get_actor(_TQ_CONTROLLER_NAME, namespace=_TQ_NAMESPACE)
        return True
    except ValueError:
        return False


def _check_same_run(ray) -> None:
    """TransferQueue's controller has a fixed namespace, but its storage units
    live in the namespace of the run that started it, where every client looks
    them up: a process of another run (another `rldsl run --address` on the
    same cluster) would attach, then fail on its first row with Ray's lookup
    error. It is refused here, named. (A run's namespace is its own, so two
    runs' named actors never meet.)"""
    name = f"{_TQ_STORAGE_UNIT_PREFIX}0"
    try:
        ray.get_actor(name)
        return
    except ValueError:
        pass
    from ray.util import list_named_actors

    owners = sorted({a["namespace"] for a in list_named_actors(all_namespaces=True) if a["name"] == name})
    raise DataPlaneUnavailable(
        f"this Ray cluster already runs the TransferQueue data plane of another run (Ray namespace "
        f"{', '.join(owners) or 'unknown'}; this run's is {ray.get_runtime_context().namespace}), and TransferQueue "
        "serves one run per cluster: wait for that run to finish, or start this one on a Ray of its own "
        "(without --address it starts a local one)")


def _check_cpus_for_transferqueue(ray, storage_units: int) -> None:
    """tq.init blocks forever if its actors (1 CPU each) cannot be placed."""
    needed = 1 + storage_units
    available = ray.available_resources().get("CPU", 0.0)
    if available < needed:
        raise DataPlaneUnavailable(
            f"TransferQueue needs {needed} free logical CPUs (controller + {storage_units} storage "
            f"unit(s), 1 CPU each) but Ray has {available:g} available "
            f"(total {ray.cluster_resources().get('CPU', 0):g}). Start Ray with more logical CPUs "
            "(rldsl.runtime.ray_lowering.cluster.start_ray does) or use fewer storage units."
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


class _UnmarkedDynamo(types.ModuleType):
    """``torch._dynamo`` as a get sees it (``_dynamic_marks_skipped``): its
    ``mark_dynamic`` does nothing; anything else is the real module's."""

    def mark_dynamic(self, *args, **kwargs) -> None:
        pass

    def __getattr__(self, name):
        return getattr(importlib.import_module("torch._dynamo"), name)


_UNMARKED_DYNAMO = _UnmarkedDynamo("torch._dynamo")


@contextlib.contextmanager
def _dynamic_marks_skipped():
    """TransferQueue hands rows back as jagged nested tensors, and building
    one marks its sequence lengths dynamic for ``torch.compile`` through
    ``torch._dynamo.mark_dynamic``, whose first use imports the whole of
    ``torch._dynamo`` (about 1.3 s of CPU and 140 MB in every process that
    reads rows). A get turns them into dense rows at once and nothing
    compiles them, so the mark is skipped while a get runs in a process
    that has not imported ``torch._dynamo``; any other use of it in that
    window (another thread) gets the real module. A process that has it
    reads as usual."""
    import sys

    import torch

    if "torch._dynamo" in sys.modules:
        yield
        return
    torch._dynamo = _UNMARKED_DYNAMO
    try:
        yield
    finally:
        if torch.__dict__.get("_dynamo") is _UNMARKED_DYNAMO:  # not replaced by a real import meanwhile
            del torch._dynamo


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
    return pad_rows(list(tensor.unbind()), pad_left)


class TransferQueueDataPlane(DataPlane):
    """TransferQueue's SimpleStorage. The first process to construct one
    starts the controller and ``storage_units`` storage actors (it is the
    owner; its ``close`` stops them); later ones, in any process of the same
    Ray cluster, attach to that controller.

    TransferQueue keeps its client in module globals: one store per process.
    After every put and get it also resets torch's thread count to the value
    it had when transfer_queue was first imported in the process."""

    backend = "transferqueue"
    blocking = True  # network calls: the controller runs them off its event loop

    def __init__(self, storage_units: int = 1, left_padded_fields: Iterable[str] = DEFAULT_LEFT_PADDED_FIELDS):
        super().__init__(left_padded_fields)
        ray, tq = _import_transferqueue()
        self._tq = tq
        self.storage_units = storage_units
        self.owner = not _transferqueue_running(ray)
        if self.owner:
            _check_cpus_for_transferqueue(ray, storage_units)
            _forget_previous_session(tq)
        else:
            _check_same_run(ray)
        # tq.init attaches when a controller exists (the config is then ignored).
        storage = {"num_data_storage_units": storage_units}
        tq.init({"backend": {"storage_backend": "SimpleStorage", "SimpleStorage": storage}})
        self._closed = False
        # one call at a time per process: threaded actors (generators) and the
        # controller's worker threads share the module-global client
        self._lock = threading.Lock()

    def _options(self) -> dict:
        return {"storage_units": self.storage_units}

    def service_actors(self) -> dict[str, object]:
        """TransferQueue's controller and storage units (SimpleStorage names
        them ``TransferQueueStorageUnit#<rank>`` in the namespace of the
        process that started them: the run's)."""
        import ray

        actors = {"controller": ray.get_actor(_TQ_CONTROLLER_NAME, namespace=_TQ_NAMESPACE)}
        for rank in range(self.storage_units):
            name = f"{_TQ_STORAGE_UNIT_PREFIX}{rank}"
            owned = (getattr(self._tq.interface, "_TQ_STORAGE", None) or {}).get("SimpleStorage", {})
            actors[f"storage unit {name}"] = owned.get(name) or ray.get_actor(name)
        return actors

    def put(self, keys, partition, fields, tags=None):
        keys = check_put(keys, fields, tags)
        if not keys or (not fields and tags is None):
            return
        from tensordict import TensorDict

        batch = TensorDict(dict(fields), batch_size=[len(keys)]) if fields else None
        with self._lock:
            self._tq.kv_batch_put(keys=keys, partition_id=partition, fields=batch, tags=tags)

    def get(self, keys, partition, fields):
        keys = check_get(keys, fields)
        fields = list(fields)
        with _dynamic_marks_skipped():
            batch = self._fetch(keys, partition, fields)
            if batch is None:
                raise self._diagnose_missing(keys, partition, fields)
            return {f: _dense_from_nested(batch[f], f in self.left_padded_fields) for f in fields}

    def _fetch(self, keys, partition, fields):
        """The TensorDict if every key has every field, else None."""
        try:
            with self._lock:
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
        with self._lock:
            return dict(self._tq.kv_list(partition_id=partition).get(partition, {}))

    def clear(self, keys, partition):
        keys = check_keys(keys)
        if keys:
            with self._lock:
                self._tq.kv_clear(keys=keys, partition_id=partition)

    def close(self):
        # Only the owner calls tq.close(): in an attached process it would
        # kill the shared controller, which every other process still uses.
        if self.owner and not self._closed:
            self._tq.close()
        self._closed = True
