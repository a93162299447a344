"""What runs inside vLLM's workers: weights loaded in place, bucket by bucket.

``BucketLoader`` is mixed into every vLLM worker (``worker_extension_cls``);
the engine calls its method by name through ``collective_rpc``. A bucket
travels as a safetensors file in shared memory (``/dev/shm``), named by its
path: ``collective_rpc`` arguments are serialised (a tensor cannot cross as
one), while a file in shared memory is read by every tensor-parallel worker
of the replica from the same pages, and no worker ever holds more than one
bucket besides the model.

Each bucket is loaded with vLLM's own layer-wise reload
(``vllm.model_executor.model_loader.reload``): the first bucket of a version
opens a reload, each bucket goes through the model's ``load_weights`` (which
shards for tensor parallelism and fuses q/k/v and gate/up), and the last one
finalises it, redoing the kernel-specific processing of every layer (the
repacking the CPU backend does), as vLLM's ``ipc`` weight-transfer engine
does between ``start_weight_update`` and ``finish_weight_update``.

Imported by vLLM's worker processes only; nothing here is imported by rldsl
outside them.
"""

from __future__ import annotations

LOAD_BUCKET_RPC = "rldsl_load_bucket"


class BucketLoader:
    """Mixed into vLLM's ``Worker``: ``self.model_runner`` is the worker's."""

    def rldsl_load_bucket(self, path: str, first: bool, last: bool) -> int:
        """Load the bucket at ``path`` into the model; returns how many tensors."""
        from safetensors.torch import load_file
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        model = self.model_runner.get_model()
        if first:
            initialize_layerwise_reload(model)
        tied = ties_word_embeddings(self.model_runner.model_config)
        weights = with_tied_output_layer(list(load_file(path).items()), tied)
        model.load_weights(weights)
        if last:
            finalize_layerwise_reload(model, self.model_runner.model_config)
        return len(weights)


def ties_word_embeddings(model_config) -> bool:
    """Whether vLLM's model ties its output layer to the embedding."""
    return bool(getattr(getattr(model_config, "hf_config", None), "tie_word_embeddings", False))


def with_tied_output_layer(items: list, tied: bool) -> list:
    """Add ``lm_head.weight`` = the embedding when a tied model's bucket has
    the embedding but not the output layer (the megatron export sends the
    shared tensor once): a reload leaves a layer that receives nothing at its
    old weights, which would untie the output layer from the new embedding."""
    names = dict(items)
    if tied and "lm_head.weight" not in names and "model.embed_tokens.weight" in names:
        return [*items, ("lm_head.weight", names["model.embed_tokens.weight"])]
    return items
