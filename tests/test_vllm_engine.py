"""The vLLM engines.

Without vLLM: request building, outputs -> batch (padding, behaviour
logprobs, the version on every row), weight-sync bookkeeping, the worker-side
staging of buckets and sleep/wake, against fakes that record their calls.

With vLLM (`-m vllm`; the GPU build, or vLLM's CPU build in an environment
of its own): generation, behaviour and scored logprobs against the torch
engine, in-place weight updates, and loading what the megatron trainer
exports, on a tiny local model. Sleep/wake needs a GPU (`-m gpu`).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from rldsl.runtime.engines import vllm as ve
from rldsl.runtime.protocols import GenerationEngine, LogprobEngine, Prompt


class FakeTokenizer:
    eos_id, bos_id = 2, 1

    def encode(self, text, add_bos=False, add_eos=False):
        return ([self.bos_id] if add_bos else []) + [10 + ord(c) % 50 for c in text]

    def decode(self, ids, stop_at_eos=True):
        return "".join(chr(int(i)) for i in ids)


def completion(tokens, logprobs):
    steps = [{token: SimpleNamespace(logprob=value), 99: SimpleNamespace(logprob=-9.0)}
             for token, value in zip(tokens, logprobs)]
    return SimpleNamespace(token_ids=tokens, logprobs=steps)


class FakeLLM:
    """Records calls; answers generate() with scripted completions."""

    def __init__(self, completions_per_prompt=None):
        self.calls = []
        self.completions_per_prompt = completions_per_prompt or []

    def generate(self, prompts, params, use_tqdm=True):
        self.calls.append(("generate", prompts, params))
        if isinstance(params, dict) and params.get("prompt_logprobs") == 0:  # log p(token t) = -0.1 t
            return [SimpleNamespace(prompt_logprobs=[None] + [{t: SimpleNamespace(logprob=-0.1 * t)}
                                                              for t in p["prompt_token_ids"][1:]])
                    for p in prompts]
        return [SimpleNamespace(outputs=self.completions_per_prompt[i]) for i in range(len(prompts))]

    def collective_rpc(self, method, args=()):
        self.calls.append(("rpc", method, args))
        return [len(ve.unpack_bucket(args[0]))] if args else [0]

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up",))


def make_generator(llm, **options):
    return ve.VLLMGenerator(llm, FakeTokenizer(), ve.VLLMOptions(**options), max_new_tokens=4,
                            make_sampling_params=dict)


PROMPTS = [Prompt(0, "ab", "x"), Prompt(1, "abcd", "y")]


def scripted_llm():
    return FakeLLM([
        [completion([5, 2], [-0.5, -0.25]), completion([7, 8, 9, 6], [-1.0, -2.0, -3.0, -4.0])],
        [completion([2], [-0.125]), completion([4, 4, 2], [-0.1, -0.2, -0.3])],
    ])


def test_module_imports_without_vllm():
    code = "import sys; sys.modules['vllm'] = None; import rldsl.runtime.engines.vllm"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_building_an_engine_without_vllm_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match=r"rldsl\[gpu\]"):
        ve.create_llm("/models/none", ve.VLLMOptions(), seed=0)


def test_engines_satisfy_the_protocols():
    assert isinstance(make_generator(FakeLLM()), GenerationEngine)
    assert isinstance(ve.VLLMLogprob(FakeLLM(), FakeTokenizer(), ve.VLLMOptions()), LogprobEngine)


def test_requests_carry_bos_token_ids_and_one_seed_per_prompt():
    llm = scripted_llm()
    make_generator(llm).generate(PROMPTS, samples_per_prompt=2, seed=3)
    _, prompts, params = llm.calls[0]
    assert prompts == [{"prompt_token_ids": FakeTokenizer().encode(p.text, add_bos=True)} for p in PROMPTS]
    assert [p["n"] for p in params] == [2, 2] and len({p["seed"] for p in params}) == 2
    assert all(p["logprobs"] == 0 and p["max_tokens"] == 4 and not p["detokenize"] for p in params)
    again = scripted_llm()
    make_generator(again).generate(PROMPTS, samples_per_prompt=2, seed=3)
    assert [p["seed"] for p in again.calls[0][2]] == [p["seed"] for p in params]


def test_outputs_become_a_prompt_major_batch_with_behaviour_logprobs():
    batch = make_generator(scripted_llm()).generate(PROMPTS, samples_per_prompt=2, seed=0)
    assert batch["response_ids"].tolist() == [[5, 2, 0, 0], [7, 8, 9, 6], [2, 0, 0, 0], [4, 4, 2, 0]]
    assert batch["response_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0]]
    assert batch["behaviour_logprobs"][1].tolist() == [-1.0, -2.0, -3.0, -4.0]
    assert batch["behaviour_logprobs"][0].tolist() == [-0.5, -0.25, 0.0, 0.0]  # 0 off the mask
    assert batch["behaviour_logprobs"].dtype == torch.float32
    assert batch["prompt_mask"].tolist() == [[0, 0, 1, 1, 1], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert batch["prompt_ids"][0, :2].tolist() == [0, 0]  # left padding


def test_every_row_carries_the_version_and_it_changes_only_with_the_last_bucket():
    llm = scripted_llm()
    engine = make_generator(llm)
    assert engine.generate(PROMPTS, 2, 0)["version"].tolist() == [0, 0, 0, 0]
    engine.update_weights({"model.norm.weight": torch.ones(3)}, version=1, last=False)
    assert engine.version == 0
    with pytest.raises(RuntimeError, match="in progress"):
        engine.generate(PROMPTS, 2, 0)
    with pytest.raises(RuntimeError, match="half applied"):
        engine.update_weights({"model.norm.weight": torch.ones(3)}, version=2, last=True)
    engine.update_weights({"lm_head.weight": torch.ones(2, 3)}, version=1, last=True)
    assert engine.version == 1
    assert engine.generate(PROMPTS, 2, 0)["version"].tolist() == [1, 1, 1, 1]


def test_buckets_are_staged_on_the_workers_and_applied_with_the_last_one():
    llm = FakeLLM()
    engine = make_generator(llm)
    weight = torch.arange(6.0).view(2, 3)
    engine.update_weights({"a.weight": weight.t()}, version=4, last=False)  # non-contiguous on purpose
    assert [c[1] for c in llm.calls] == [ve.STAGE_WEIGHTS_RPC]
    engine.update_weights({"b.weight": torch.zeros(2)}, version=4, last=True)
    assert [c[1] if c[0] == "rpc" else c[0] for c in llm.calls] == [
        ve.STAGE_WEIGHTS_RPC, ve.STAGE_WEIGHTS_RPC, ve.APPLY_WEIGHTS_RPC, "reset_prefix_cache"]
    (name, sent), = ve.unpack_bucket(llm.calls[0][2][0])
    assert name == "a.weight" and torch.equal(sent, weight.t()) and sent.is_contiguous()
    with pytest.raises(TypeError):
        engine.update_weights({"a.weight": [1, 2]}, version=5, last=True)


def test_sleep_and_wake_follow_the_sleep_option():
    llm = scripted_llm()
    engine = make_generator(llm, sleep=True, sleep_level=1)
    engine.sleep()
    engine.sleep()  # idempotent
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(PROMPTS, 2, 0)
    with pytest.raises(RuntimeError, match="wake"):
        engine.update_weights({"x": torch.ones(1)}, 1, True)
    engine.wake()
    engine.generate(PROMPTS, 2, 0)
    assert [c[0] for c in llm.calls[:2]] == ["sleep", "wake_up"] and llm.calls[0] == ("sleep", 1)
    never = FakeLLM()
    engine = make_generator(never, sleep=False)
    engine.sleep()
    engine.wake()
    assert never.calls == []


def test_llm_arguments_name_the_weight_loader_and_raw_logprobs():
    kwargs = ve.VLLMOptions(tp=2, gpu_memory=0.5, max_model_len=2048, dtype="bf16").llm_kwargs("/models/m", seed=1)
    assert kwargs["tensor_parallel_size"] == 2 and kwargs["gpu_memory_utilization"] == 0.5
    assert kwargs["dtype"] == "bfloat16" and kwargs["max_model_len"] == 2048 and kwargs["enable_sleep_mode"]
    assert kwargs["logprobs_mode"] == "raw_logprobs" and kwargs["distributed_executor_backend"] == "mp"
    module, _, cls = kwargs["worker_extension_cls"].rpartition(".")
    assert getattr(importlib.import_module(module), cls) is ve.VLLMWeightLoader


def test_a_tied_model_gets_its_output_layer_from_the_embedding_when_the_sync_omits_it():
    embedding = torch.ones(4, 2)
    worker = FakeWorker(with_reload=True, tied=True)
    worker.rldsl_stage_weights(ve.pack_bucket([("model.embed_tokens.weight", embedding)]))
    worker.rldsl_apply_weights()
    (_, items), = worker.received
    assert [n for n, _ in items] == ["model.embed_tokens.weight", "lm_head.weight"]
    assert torch.equal(items[1][1], embedding)
    untied = FakeWorker(with_reload=True, tied=False)
    untied.rldsl_stage_weights(ve.pack_bucket([("model.embed_tokens.weight", embedding)]))
    untied.rldsl_apply_weights()
    assert [n for n, _ in untied.received[0][1]] == ["model.embed_tokens.weight"]


class FakeWorker(ve.VLLMWeightLoader):
    def __init__(self, with_reload: bool, tied: bool = False):
        self.received = []
        model = SimpleNamespace(load_weights=lambda weights: self.received.append(("load_weights", list(weights))))
        config = SimpleNamespace(hf_config=SimpleNamespace(tie_word_embeddings=tied))
        self.model_runner = SimpleNamespace(model=model, model_config=config)
        if with_reload:
            self.reload_weights = lambda weights_iterator, is_checkpoint_format: self.received.append(
                ("reload_weights", list(weights_iterator)))


@pytest.mark.parametrize("with_reload", [True, False], ids=["reload_weights", "load_weights"])
def test_worker_stages_buckets_and_applies_them_all_at_once(with_reload):
    worker = FakeWorker(with_reload)
    assert worker.rldsl_stage_weights(ve.pack_bucket([("w", torch.ones(2, dtype=torch.bfloat16))])) == 1
    assert worker.rldsl_stage_weights(ve.pack_bucket([("b", torch.arange(3))])) == 2
    assert worker.received == []
    assert worker.rldsl_apply_weights() == 2
    (how, items), = worker.received
    assert how == ("reload_weights" if with_reload else "load_weights")
    assert [n for n, _ in items] == ["w", "b"] and items[0][1].dtype == torch.bfloat16
    assert torch.equal(items[1][1], torch.arange(3))
    assert worker.rldsl_apply_weights() == 0  # staging was emptied


def test_logprob_engine_reads_the_response_positions_of_prompt_logprobs():
    llm = FakeLLM()
    engine = ve.VLLMLogprob(llm, FakeTokenizer(), ve.VLLMOptions(), make_sampling_params=dict)
    batch = {"prompt_ids": torch.tensor([[0, 1, 11], [1, 12, 13]]),
             "prompt_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
             "response_ids": torch.tensor([[20, 21, 0], [22, 0, 0]]),
             "response_mask": torch.tensor([[1, 1, 0], [1, 0, 0]])}
    values = engine.logprobs(batch)
    _, prompts, params = llm.calls[0]
    assert prompts == [{"prompt_token_ids": [1, 11, 20, 21]}, {"prompt_token_ids": [1, 12, 13, 22]}]
    assert params == {"max_tokens": 1, "prompt_logprobs": 0, "detokenize": False}
    assert torch.allclose(values, torch.tensor([[-2.0, -2.1, 0.0], [-2.2, 0.0, 0.0]]))


# -- on a GPU with vLLM ----------------------------------------------------------------------

HAS_CUDA = torch.cuda.is_available()
HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    pytest.importorskip("transformers", reason="transformers is not installed")
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


def write_tiny_checkpoint(path, tied: bool = False):
    """A random 2-layer Llama with a character tokenizer, saved for offline loading."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{chr(c): c - 29 for c in range(32, 127)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                                     pad_token="<pad>")
    tokenizer.save_pretrained(path)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=tied)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)  # head_dim 64: vLLM's kernels need >= 64
    return path


def real_engine(path, **options):
    """A real vLLM engine: on a GPU, or on a CPU with the vllm-cpu build (docs/engines.md)."""
    defaults = dict(gpu_memory=0.3, dtype="fp32", max_model_len=256, enforce_eager=True, sleep=HAS_CUDA)
    return ve.VLLMGenerator.from_path(str(path), ve.VLLMOptions(**{**defaults, **options}), seed=0, max_new_tokens=8)


def torch_logprobs(model, batch):
    from rldsl.runtime.engines.torch.common import response_logprobs

    with torch.no_grad():
        return response_logprobs(model, batch)


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (pip install 'rldsl[gpu]' on a GPU machine)")
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_vllm_behaviour_logprobs_and_in_place_weight_update(tmp_path, tied, monkeypatch):
    pytest.importorskip("transformers", reason="transformers is not installed")
    from rldsl.models.hf import load_hf_model
    from rldsl.runtime.engines.torch.common import state_buckets

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, for the CPU build; ignored on a GPU
    path = write_tiny_checkpoint(tmp_path, tied=tied)
    engine = real_engine(path)
    batch = engine.generate(PROMPTS, samples_per_prompt=4, seed=1)
    assert batch["version"].tolist() == [0] * 8
    assert torch.equal(engine.generate(PROMPTS, 4, 1)["response_ids"], batch["response_ids"])  # seeded
    reference = load_hf_model(str(path))
    assert float((batch["behaviour_logprobs"] - torch_logprobs(reference, batch)).abs().max()) < 1e-4
    with torch.no_grad():
        for parameter in reference.module.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    buckets = list(state_buckets(reference.module, 1 << 16))
    if tied:  # as the megatron engine exports a tied model: the shared tensor once, as the embedding
        buckets = [{n: t for n, t in b.items() if n != "lm_head.weight"} for b in buckets]
    for index, bucket in enumerate(buckets):
        engine.update_weights(bucket, version=1, last=index == len(buckets) - 1)
    batch = engine.generate(PROMPTS, samples_per_prompt=4, seed=1)
    expected = torch_logprobs(reference, batch)
    assert batch["version"].tolist() == [1] * 8
    assert float((batch["behaviour_logprobs"] - expected).abs().max()) < 1e-4
    scorer = ve.VLLMLogprob(engine.llm, engine.tokenizer, engine.options)
    assert float((scorer.logprobs(batch) - expected).abs().max()) < 1e-4


HAS_MEGATRON = importlib.util.find_spec("megatron") is not None


@pytest.mark.vllm
@pytest.mark.megatron
@pytest.mark.skipif(not (HAS_VLLM and HAS_MEGATRON), reason="needs vLLM and megatron-core (pip install 'rldsl[gpu]')")
def test_vllm_loads_what_the_megatron_trainer_exports(tmp_path, monkeypatch):
    """The weight-sync path end to end: train a step, export, load in place."""
    pytest.importorskip("transformers", reason="transformers is not installed")
    from rldsl.models.hf import load_hf_model
    from rldsl.runtime.engines.megatron.trainer import MegatronTrainer

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    path = write_tiny_checkpoint(tmp_path, tied=True)  # the export sends the tied tensor once
    engine = real_engine(path)
    rollout = engine.generate(PROMPTS, samples_per_prompt=4, seed=1)
    rollout["advantage"] = torch.linspace(-1, 1, len(rollout["version"]))
    with megatron_context():
        trainer = MegatronTrainer.from_pretrained(str(path), dtype="fp32", distributed_optimizer=False, lr=1e-2)
        trainer.begin_train_step(0)
        trainer.train_microbatch(0, rollout)
        assert trainer.finish_train_step(0).version == 1
        buckets = list(trainer.weight_buckets(1 << 16))
    for index, bucket in enumerate(buckets):
        engine.update_weights(bucket, version=1, last=index == len(buckets) - 1)
    trained = load_hf_model(str(path))
    trained.module.load_state_dict({n: t for b in buckets for n, t in b.items()}, strict=False)
    batch = engine.generate(PROMPTS, samples_per_prompt=4, seed=1)
    assert batch["version"].tolist() == [1] * 8
    assert float((batch["behaviour_logprobs"] - torch_logprobs(trained, batch)).abs().max()) < 1e-4


def megatron_context():
    """On a CPU megatron-core needs the test-only shim; on a GPU nothing."""
    if HAS_CUDA:
        import contextlib

        return contextlib.nullcontext()
    from rldsl.runtime.engines.megatron.cpu_compat import megatron_on_cpu

    return megatron_on_cpu()


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.skipif(not (HAS_CUDA and HAS_VLLM), reason="needs a CUDA GPU and vLLM (pip install 'rldsl[gpu]')")
def test_vllm_sleeps_and_wakes_with_its_weights(tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed")
    engine = real_engine(write_tiny_checkpoint(tmp_path), sleep=True)
    before = engine.generate(PROMPTS, samples_per_prompt=2, seed=5)
    free_awake = torch.cuda.mem_get_info()[0]
    engine.sleep()
    assert torch.cuda.mem_get_info()[0] > free_awake  # the KV cache and weights left the GPU
    engine.wake()
    after = engine.generate(PROMPTS, samples_per_prompt=2, seed=5)
    assert torch.equal(before["response_ids"], after["response_ids"])
