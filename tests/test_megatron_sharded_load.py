"""Megatron ranks read only their shard of a Hugging Face checkpoint.

- pure torch: a rank's shards read slice by slice equal the tensor-parallel
  split of the full conversion, for GQA, q/k/v biases, tied embeddings and
  both norm naming styles;
- a tiny Llama saved as safetensors split over several files (through the
  index; q, k and v of one layer in different files): two processes over
  gloo build the logprob engine from it with tp = 2 and with pp = 2, and
  each rank's weights equal those of the full-read path bit for bit, while
  the bytes it reads from the files are exactly the size of its own
  parameters (about half the checkpoint);
- a ``.bin`` checkpoint is read whole, with a warning.
"""

from __future__ import annotations

import contextlib
import logging

import pytest

from tests.ports import spawn_ranks
import torch

from rldsl.runtime.engines.megatron import hf_weights as hmw
from tests.test_megatron_engine import SHAPES, random_hf_weights

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

# Query groups that split over tp = 4, q/k/v biases and tied embeddings.
WIDE_GQA = hmw.LlamaShape(hidden_size=32, ffn_hidden_size=48, num_layers=2, num_heads=8, num_kv_heads=4,
                          vocab_size=64, max_positions=64, qkv_bias=True, tied_embeddings=True)
LAYOUTS = [(2, 1), (1, 2)]  # (tp, pp) on two ranks


def full_read_shards(hf, shape, tp: int, tp_rank: int, fused_norms: bool = False) -> dict[str, torch.Tensor]:
    """The full-read path: convert everything, then split."""
    full = hmw.hf_to_megatron(hf, shape, fused_norms)
    return {name: hmw.split_for_tensor_parallel(name, tensor, tp)[tp_rank] for name, tensor in full.items()}


# -- pure torch ------------------------------------------------------------------------------


@pytest.mark.parametrize("fused_norms", [False, True], ids=["local", "te"])
@pytest.mark.parametrize(("shape", "tp"), [(SHAPES["llama"], 2), (WIDE_GQA, 2), (WIDE_GQA, 4)],
                         ids=["llama-tp2", "gqa-bias-tied-tp2", "gqa-bias-tied-tp4"])
def test_shards_read_slice_by_slice_equal_the_split_of_the_full_conversion(shape, tp, fused_norms):
    hf = random_hf_weights(shape, seed=3)
    whole = sum(t.numel() * t.element_size() for t in hf.values())
    replicated = sum(t.numel() * t.element_size() for n, t in hf.items() if n.endswith("norm.weight"))
    for tp_rank in range(tp):
        expected = full_read_shards(hf, shape, tp, tp_rank, fused_norms)
        source = hmw.HFTensors(hf)
        shards = dict(hmw.tensor_parallel_shards(source, shape, tp, tp_rank, expected, fused_norms))
        assert shards.keys() == expected.keys()
        assert all(torch.equal(shards[name], expected[name]) for name in expected)
        assert source.bytes_read == (whole - replicated) // tp + replicated


def test_a_missing_tensor_of_a_wanted_shard_is_a_clear_error():
    shape = SHAPES["llama"]
    hf = random_hf_weights(shape)
    del hf["model.layers.1.self_attn.v_proj.weight"]
    qkv = "decoder.layers.{}.self_attention.linear_qkv.weight"
    with pytest.raises(KeyError, match="missing 1 tensors"):
        list(hmw.tensor_parallel_shards(hmw.HFTensors(hf), shape, 2, 0, [qkv.format(1)]))
    # A stage that holds only layer 0 does not need it.
    assert len(list(hmw.tensor_parallel_shards(hmw.HFTensors(hf), shape, 2, 0, [qkv.format(0)]))) == 1


# -- a tiny Llama on disk ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """Untied and tied tiny Llamas, each in three safetensors files and an index."""
    pytest.importorskip("transformers")
    import transformers

    from tests.hf_tiny import save_char_llama

    paths = {}
    for kind, tied in (("untied", False), ("tied", True)):
        path = save_char_llama(tmp_path_factory.mktemp(kind), vocab_multiple=2, num_attention_heads=4,
                               num_key_value_heads=2, tie_word_embeddings=tied)
        model = transformers.LlamaForCausalLM.from_pretrained(path)
        (path / "model.safetensors").unlink()
        model.save_pretrained(path, max_shard_size="40KB")
        assert len(list(path.glob("*.safetensors"))) >= 2 and (path / "model.safetensors.index.json").exists()
        paths[kind] = str(path)
    return paths


class _CountingSlice:
    def __init__(self, name, inner, reads):
        self.name, self.inner, self.reads = name, inner, reads

    def get_shape(self):
        return self.inner.get_shape()

    def __getitem__(self, index):
        tensor = self.inner[index]
        self.reads.append((self.name, tensor.numel() * tensor.element_size(), tensor.numel()))
        return tensor


class _CountingFile:
    """A ``safe_open`` handle that records every tensor (or slice) read from it."""

    def __init__(self, inner, reads):
        self.inner, self.reads = inner, reads

    def keys(self):
        return self.inner.keys()

    def get_slice(self, name):
        return _CountingSlice(name, self.inner.get_slice(name), self.reads)

    def get_tensor(self, name):
        tensor = self.inner.get_tensor(name)
        self.reads.append((name, tensor.numel() * tensor.element_size(), tensor.numel()))
        return tensor


@contextlib.contextmanager
def counting_reads():
    """Every read from safetensors files opened inside, as (name, bytes, elements)."""
    import safetensors

    reads, real = [], safetensors.safe_open
    safetensors.safe_open = lambda path, framework, **kw: _CountingFile(real(path, framework, **kw), reads)
    try:
        yield reads
    finally:
        safetensors.safe_open = real


def test_safetensors_slices_equal_the_full_read_and_read_only_the_share(checkpoints):
    from rldsl.models.hf_checkpoint import open_hf_weights, read_hf_config, read_hf_weights

    path = checkpoints["untied"]
    shape = hmw.LlamaShape.from_hf_config(read_hf_config(path))
    full = read_hf_weights(path)
    whole = sum(t.numel() * t.element_size() for t in full.values())
    for tp_rank in range(2):
        expected = full_read_shards(full, shape, 2, tp_rank)
        with counting_reads() as reads:
            source = open_hf_weights(path)
            shards = dict(hmw.tensor_parallel_shards(source, shape, 2, tp_rank, expected))
        assert all(torch.equal(shards[name], expected[name]) for name in expected)
        assert sum(size for _, size, _ in reads) == source.bytes_read < 0.6 * whole
        for name, _, elements in reads:
            assert elements * (1 if name.endswith("norm.weight") else 2) == full[name].numel(), name


def test_a_bin_checkpoint_is_read_whole_with_a_warning(tmp_path, caplog):
    from rldsl.models.hf_checkpoint import open_hf_weights

    hf = random_hf_weights(SHAPES["llama"])
    torch.save(hf, tmp_path / "pytorch_model.bin")
    with caplog.at_level(logging.WARNING):
        source = open_hf_weights(tmp_path)
    assert "whole checkpoint" in caplog.text and "safetensors" in caplog.text
    assert source.keys() == hf.keys() and all(torch.equal(source[n], hf[n]) for n in hf)


# -- two processes over gloo: tp = 2 and pp = 2 ---------------------------------------------------


def _load_both_ways(path: str, tp: int, pp: int) -> dict:
    """This rank's weights by the full-read path (every parameter NaN before,
    so nothing is left unloaded) and by ``from_pretrained``, with its reads."""
    from rldsl.runtime.engines.megatron import model as mm
    from rldsl.runtime.engines.megatron.logprob import MegatronLogprob

    shape = hmw.LlamaShape.from_hf_config(mm.read_hf_config(path))
    old = mm.build_gpt_model(shape, mm.transformer_config(shape, "fp32", tp, pp))
    with torch.no_grad():
        for parameter in old.parameters():
            parameter.fill_(float("nan"))
    mm.load_megatron_weights(old, hmw.hf_to_megatron(mm.read_hf_weights(path), shape), shape)
    with counting_reads() as reads:
        engine = MegatronLogprob.from_pretrained(path, tp=tp, pp=pp, dtype="fp32")
    return {"old": mm.local_weights(old, shape), "new": mm.local_weights(engine.model, shape), "reads": reads}


def _worker(rank: int, port: int, checkpoints: dict, results: dict):
    import torch.distributed as dist
    from megatron.core import parallel_state

    from rldsl.runtime.engines.megatron import model as mm
    from rldsl.runtime.engines.megatron.cpu_compat import megatron_on_cpu

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        with megatron_on_cpu():
            for tp, pp in LAYOUTS:
                mm.ensure_model_parallel(tp, pp, seed=0)
                for kind, path in checkpoints.items():
                    results[(kind, tp, pp, rank)] = _load_both_ways(path, tp, pp)
                parallel_state.destroy_model_parallel()
    finally:
        dist.destroy_process_group()



@pytest.mark.megatron
def test_each_rank_reads_only_its_shard_and_gets_the_full_read_weights(checkpoints):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'rldsl[gpu]')")

    from rldsl.models.hf_checkpoint import read_hf_weights

    results = spawn_ranks(_worker, dict(checkpoints))
    for kind, path in checkpoints.items():
        whole = sum(t.numel() * t.element_size() for t in read_hf_weights(path).values())
        for tp, pp in LAYOUTS:
            for rank in range(2):
                got = results[(kind, tp, pp, rank)]
                old, new = got["old"], got["new"]
                assert new.keys() == old.keys()
                assert all(torch.equal(new[name], old[name]) for name in old), (kind, tp, pp, rank)
                own = sum(t.numel() * t.element_size() for t in new.values())  # fp32 on disk and in the model
                read = sum(size for _, size, _ in got["reads"])
                assert read == own < 0.6 * whole, (kind, tp, pp, rank, read, own, whole)
