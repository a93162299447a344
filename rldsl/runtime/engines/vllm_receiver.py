"""vLLM's workers in an rldsl weight group: each push streams from the
trainer straight into every worker's model.

vLLM's weight-transfer API (``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights``, ``finish_weight_update``)
hands a push to an engine of the backend the replica starts with
(``weight_transfer_config``). Its own ``nccl`` backend speaks vLLM's
protocol over NCCL only (``PyNcclCommunicator``); this backend,
``rldsl-stream``, registered in vLLM's factory when a worker imports this
module (it is the ``worker_extension_cls``), makes each worker one more
rank of the pipeline's weight group (rldsl.runtime.transport: gloo on a
CPU, NCCL on GPUs) and reads the buckets the trainer's rank 0 broadcasts
to every member. Each bucket goes through the model's ``load_weights``
(which takes a tensor-parallel worker's shard and fuses q/k/v and gate/up)
inside vLLM's layer-wise reload, as vLLM's ``nccl`` and ``ipc`` backends
load theirs; nothing passes through the replica's actor or host memory
beyond the bucket being read.

Imported by vLLM's worker processes only: it imports vLLM.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from rldsl.runtime.engines.vllm_async import STREAM_BACKEND
from rldsl.runtime.engines.vllm_worker import BucketLoader, ties_word_embeddings, with_tied_output_layer
from rldsl.runtime.transport.group import form_group, open_store
from rldsl.runtime.transport.stream import StreamStats, receive_buckets


@dataclass
class StreamInitInfo(WeightTransferInitInfo):
    """A weight group to join: its name, this replica's first rank, its size,
    where its store is (``file://PATH`` or ``tcp://HOST:PORT``), the
    collectives' timeout and the file whose existence calls a push off."""

    group: str
    rank_offset: int
    size: int
    store: str
    timeout_s: float
    called_off_file: str


@dataclass
class StreamUpdateInfo(WeightTransferUpdateInfo):
    version: int


class StreamReceiver(WeightTransferEngine[StreamInitInfo, StreamUpdateInfo]):
    """One worker's side of the weight group (see the module docstring)."""

    init_info_cls = StreamInitInfo
    update_info_cls = StreamUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.last_stats: dict = {}

    def init_transfer_engine(self, init_info: StreamInitInfo) -> None:
        """Join the group as ``rank_offset`` + this worker's rank in its replica."""
        self.shutdown()  # the previous epoch's group, if any
        parallel = self.parallel_config
        rank = init_info.rank_offset + parallel.data_parallel_index * parallel.world_size + parallel.rank
        store = open_store(init_info.store, init_info.size, is_master=False, timeout_s=init_info.timeout_s)
        device = self.device if self.device.type == "cuda" else torch.device("cpu")
        called_off = init_info.called_off_file
        self.group = form_group(store, init_info.group, rank, init_info.size, device, init_info.timeout_s,
                                should_abort=lambda: os.path.exists(called_off))

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":  # vLLM's own synchronize refuses a machine without an accelerator
            torch.cuda.current_stream().synchronize()

    def receive_weights(self, update_info: StreamUpdateInfo) -> None:
        """Every bucket of the version, each loaded as it arrives. A push
        that fails ends the reload with what arrived (the replica generates
        nothing until a whole version replaces it) and leaves the group."""
        if self.group is None:
            raise RuntimeError("this vLLM worker is in no weight group: init_weight_transfer_engine first")
        tied = ties_word_embeddings(self.model_config)
        stats = StreamStats()
        try:
            for bucket, _last in receive_buckets(self.group, update_info.version, stats):
                self.model.load_weights(with_tied_output_layer(list(bucket.items()), tied))
        except BaseException:
            self.shutdown()
            with contextlib.suppress(Exception):  # the push's own error is the one to report
                self.finish_weight_update()
            raise
        self.last_stats = stats.as_dict()

    def shutdown(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.close()


class WorkerExtension(BucketLoader):
    """Mixed into vLLM's ``Worker`` (``worker_extension_cls``): the bucket
    loader, and what the last streamed push moved on this worker."""

    def rldsl_stream_stats(self) -> dict:
        engine = getattr(self, "weight_transfer_engine", None)
        return dict(getattr(engine, "last_stats", {}))


def _register() -> None:
    try:
        WeightTransferEngineFactory.register_engine(STREAM_BACKEND, StreamReceiver)
    except ValueError:  # registered already (the module imported again)
        pass


_register()
