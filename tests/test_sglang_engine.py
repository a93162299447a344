"""The SGLang engines, without SGLang.

A fake stands where the real engine cannot run: SGLang's engine needs a
CUDA GPU (it has no CPU build here, unlike vLLM, whose real CPU build the
vLLM tests run), so these tests drive its API shape without a model.

`FakeSGLangEngine` follows the parts of ``sglang.Engine`` the engine uses,
with the signatures and output format of SGLang's source
(python/sglang/srt/entrypoints/engine.py): ``generate(prompt=None,
sampling_params=None, input_ids=None, ..., return_logprob=False,
logprob_start_len=None, ...)`` returning one dict per request
(``{"output_ids", "meta_info"}`` when the tokenizer is skipped, with
``meta_info["output_token_logprobs"]`` as ``(logprob, token_id, None)``),
``update_weights_from_tensor(named_tensors, load_format=None,
flush_cache=True)`` answering ``(success, message)``, and
``release_memory_occupation(tags=None)`` / ``resume_memory_occupation(tags=None)``.
Started deterministic (``enable_deterministic_inference``), its tokens are
a function of the prompt, the request's seed and the weight version it
holds; otherwise, as SGLang's, fresh draws whatever the seed.
"""

from __future__ import annotations

import importlib.util
import random
import subprocess
import sys

import pytest
import torch

from rldsl.compiler.driver import compile_source
from rldsl.runtime.engines import sglang as se
from rldsl.runtime.engines.batching import ContinuousBatcher
from rldsl.runtime.protocols import GenerationEngine, LogprobEngine, Prompt
from tests.test_help_texts import BASE, GPU_CLUSTER

class FakeTokenizer:
    """A character tokenizer (the engine is started without SGLang's)."""
    eos_id, bos_id = 2, 1

    def encode(self, text, add_bos=False, add_eos=False):
        return ([self.bos_id] if add_bos else []) + [10 + ord(c) % 50 for c in text]

    def decode(self, ids, stop_at_eos=True):
        return "".join(chr(int(i)) for i in ids)


EOS = FakeTokenizer.eos_id


class FakeSGLangEngine:
    """Records calls; answers like ``sglang.Engine`` with scripted tokens. The engine sends each sample
    as a request of its own, without ``stream``, and SGLang then answers each request whole, as this
    does (a streaming call is refused: the engine makes none). As SGLang, it honours a
    request's ``sampling_seed`` only when started with ``enable_deterministic_inference``
    (``deterministic``); otherwise every sample is a fresh draw, whatever its seed."""

    def __init__(self, eos_after: dict[int, int] | None = None, deterministic: bool = False):
        self.calls = []
        self.weights_version = 0  # bumped by every update_weights_from_tensor
        self.released = False
        self.eos_after = eos_after or {}  # seed -> tokens before EOS (deterministic only)
        self.deterministic = deterministic
        self.draws = random.Random()  # unseeded: what a non-deterministic SGLang samples

    def generate(self, prompt=None, sampling_params=None, input_ids=None, image_data=None, audio_data=None,
                 video_data=None, return_logprob=False, logprob_start_len=None, top_logprobs_num=None,
                 token_ids_logprob=None, lora_path=None, custom_logit_processor=None, return_hidden_states=False,
                 stream=False, rid=None, **_ignored):
        assert prompt is None and not stream and not self.released
        self.calls.append(("generate", input_ids, sampling_params, return_logprob, logprob_start_len))
        single = bool(input_ids) and isinstance(input_ids[0], int)
        rows = [input_ids] if single else input_ids
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(rows)
        outputs = [self._one(ids, p, return_logprob, logprob_start_len) for ids, p in zip(rows, params)]
        return outputs[0] if single else outputs

    def _one(self, ids, params, return_logprob, logprob_start_len):
        tokens = self._tokens(ids, params)
        finish = ({"type": "stop", "matched": EOS} if tokens[-1:] == [EOS]
                  else {"type": "length", "length": len(tokens)})
        meta = {"id": "r", "finish_reason": finish, "prompt_tokens": len(ids), "completion_tokens": len(tokens)}
        if return_logprob:
            meta["output_token_logprobs"] = [(self.logprob(t), t, None) for t in tokens]
            start = logprob_start_len or 0
            meta["input_token_logprobs"] = [(None if i == 0 else self.logprob(t), t, None)
                                            for i, t in enumerate(ids) if i >= start]
        return {"output_ids": list(tokens), "meta_info": meta}

    def _tokens(self, ids, params):
        limit = params.get("max_new_tokens", 128)
        if not self.deterministic:
            return [self.draws.randrange(20, 50) for _ in range(limit)]
        seed = params.get("sampling_seed", 0)
        tokens = [20 + (seed + len(ids) + self.weights_version + k) % 30 for k in range(limit)]
        stop = self.eos_after.get(seed)
        return tokens[:stop] + [EOS] if stop is not None and stop < limit else tokens

    def logprob(self, token: int) -> float:
        return -0.01 * token - self.weights_version

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        assert not self.released
        self.calls.append(("update_weights_from_tensor", [n for n, _ in named_tensors], flush_cache))
        self.weights_version += 1
        return True, "Succeeded to update model weights."

    def release_memory_occupation(self, tags=None):
        self.calls.append(("release_memory_occupation", tags))
        self.released = True

    def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume_memory_occupation", tags))
        self.released = False


PROMPTS = [Prompt(0, "ab", "x"), Prompt(1, "abcd", "y")]


def make_generator(engine=None, **options):
    """A generator over ``engine`` (default: a fake started as the options say)."""
    engine = engine or FakeSGLangEngine(deterministic=options.get("deterministic", False))
    return se.SGLangGenerator(engine, FakeTokenizer(), se.SGLangOptions(**options), max_new_tokens=4,
                              temperature=0.7, top_p=0.9)


def calls(engine, kind):
    return [c for c in engine.calls if c[0] == kind]


def test_module_imports_without_sglang():
    code = "import sys; sys.modules['sglang'] = None; import rldsl.runtime.engines.sglang"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_building_an_engine_without_sglang_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)
    with pytest.raises(ImportError, match="sglang"):
        se.create_engine("/models/none", se.SGLangOptions(), seed=0)


def test_engines_satisfy_the_protocols():
    assert isinstance(make_generator(), GenerationEngine)
    assert isinstance(se.SGLangLogprob(FakeSGLangEngine(), FakeTokenizer(), se.SGLangOptions()), LogprobEngine)


def test_each_sample_is_its_own_token_id_request_with_sampling_params_and_a_seed():
    engine = FakeSGLangEngine()
    make_generator(engine).generate(PROMPTS, samples_per_prompt=2, seed=3)
    (_, inputs, params, return_logprob, _), = calls(engine, "generate")
    encoded = [FakeTokenizer().encode(p.text, add_bos=True) for p in PROMPTS]
    assert inputs == [encoded[0], encoded[0], encoded[1], encoded[1]] and return_logprob
    assert all(p["max_new_tokens"] == 4 and p["temperature"] == 0.7 and p["top_p"] == 0.9 and p["n"] == 1
               for p in params)
    assert len({p["sampling_seed"] for p in params}) == 4
    again = FakeSGLangEngine()
    make_generator(again).generate(PROMPTS, samples_per_prompt=2, seed=3)
    assert calls(again, "generate")[0][2] == params  # reproducible


def test_outputs_become_a_prompt_major_batch_with_aligned_logprobs_and_eos_kept():
    engine = FakeSGLangEngine(deterministic=True)  # EOS scripted per seed
    seeds = se.sample_seeds(0, 2, 2)
    engine.eos_after = {seeds[0][0]: 1, seeds[1][1]: 0}
    batch = make_generator(engine).generate(PROMPTS, samples_per_prompt=2, seed=0)
    ids, mask = batch["response_ids"], batch["response_mask"]
    assert ids.shape == (4, 4) and batch["prompt_ids"].shape == (4, 5)
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert ids[0, 1] == EOS and ids[3, 0] == EOS and ids[0, 2:].tolist() == [0, 0]
    expected = torch.where(mask.bool(), -0.01 * ids.float(), torch.zeros(()))
    assert torch.allclose(batch["behaviour_logprobs"], expected) and batch["behaviour_logprobs"].dtype == torch.float32
    assert batch["prompt_mask"].tolist()[0] == [0, 0, 1, 1, 1] and batch["prompt_ids"][0, :2].tolist() == [0, 0]
    assert batch["version"].tolist() == [0, 0, 0, 0]


def test_logprob_tokens_must_agree_with_output_ids():
    output = {"output_ids": [5, 6], "meta_info": {"output_token_logprobs": [(-0.1, 5, None), (-0.2, 7, None)]}}
    with pytest.raises(RuntimeError, match="differ"):
        se.sampled_tokens_and_logprobs(output)
    with pytest.raises(RuntimeError, match="return_logprob"):
        se.sampled_tokens_and_logprobs({"output_ids": [5], "meta_info": {}})


def test_groups_go_in_one_call_and_a_bad_group_fails_alone():
    engine = FakeSGLangEngine()
    empty = Prompt(2, "", "z")
    tokenizer = FakeTokenizer()
    tokenizer.encode = lambda text, add_bos=False: [] if not text else FakeTokenizer().encode(text, add_bos)
    generator = se.SGLangGenerator(engine, tokenizer, se.SGLangOptions(), max_new_tokens=3)
    out = generator.generate_groups([(PROMPTS, 2, 1), ([empty], 2, 2), (PROMPTS[:1], 3, 3)])
    assert len(calls(engine, "generate")) == 1 and len(calls(engine, "generate")[0][1]) == 4 + 3
    assert out[0]["response_ids"].shape[0] == 4 and isinstance(out[1], ValueError)
    assert out[2]["response_ids"].shape[0] == 3


def test_a_single_request_answered_unwrapped_still_becomes_a_batch():
    batch = make_generator().generate(PROMPTS[:1], samples_per_prompt=1, seed=0)
    assert batch["response_ids"].shape == (1, 4)


def test_version_changes_only_with_the_last_bucket_and_every_bucket_is_applied_at_once():
    engine = FakeSGLangEngine()
    generator = make_generator(engine)
    generator.update_weights({"a.weight": torch.arange(6.0).view(2, 3).t()}, version=1, last=False)
    assert generator.version == 0 and calls(engine, "update_weights_from_tensor") == []
    with pytest.raises(RuntimeError, match="in progress"):
        generator.generate(PROMPTS, 1, 0)
    with pytest.raises(RuntimeError, match="half applied"):
        generator.update_weights({"b.weight": torch.ones(1)}, version=2, last=True)
    generator.update_weights({"b.weight": torch.ones(2)}, version=1, last=True)
    assert calls(engine, "update_weights_from_tensor") == [("update_weights_from_tensor", ["a.weight", "b.weight"],
                                                            True)]
    assert generator.version == 1 and generator.generate(PROMPTS, 2, 0)["version"].tolist() == [1, 1, 1, 1]
    with pytest.raises(TypeError):
        generator.update_weights({"a.weight": [1, 2]}, version=2, last=True)


def test_a_failed_weight_load_raises():
    engine = FakeSGLangEngine()
    engine.update_weights_from_tensor = lambda named_tensors, load_format=None, flush_cache=True: (False, "bad name")
    with pytest.raises(RuntimeError, match="bad name"):
        make_generator(engine).update_weights({"x": torch.ones(1)}, version=1, last=True)


def test_weights_swap_between_batches_never_inside_one():
    """Through the batcher: a version pushed while a batch decodes lands after
    it, and every row of a batch carries one version whose weights made it."""
    engine = FakeSGLangEngine()
    generator = make_generator(engine)
    batcher = ContinuousBatcher(generator)
    original = engine.generate

    def generate_while_a_push_arrives(*args, **kwargs):
        if engine.weights_version == 0 and not calls(engine, "generate"):
            batcher.update_weights({"w": torch.ones(2)}, version=1, last=True)  # mid-batch
        return original(*args, **kwargs)

    engine.generate = generate_while_a_push_arrives
    try:
        first = batcher.submit(PROMPTS, 2, 0)
        second = batcher.submit(PROMPTS, 2, 0)
    finally:
        batcher.close()
    assert first["version"].tolist() == [0] * 4 and second["version"].tolist() == [1] * 4
    assert torch.allclose(first["behaviour_logprobs"][first["response_mask"].bool()],
                          -0.01 * first["response_ids"][first["response_mask"].bool()].float())
    assert torch.allclose(second["behaviour_logprobs"][second["response_mask"].bool()],
                          -0.01 * second["response_ids"][second["response_mask"].bool()].float() - 1)
    kinds = [c[0] for c in engine.calls]
    assert kinds == ["generate", "update_weights_from_tensor", "generate"]


def test_sleep_and_wake_release_and_resume_the_gpu():
    engine = FakeSGLangEngine()
    generator = make_generator(engine, sleep=True)
    generator.sleep()
    generator.sleep()  # idempotent
    with pytest.raises(RuntimeError, match="asleep"):
        generator.generate(PROMPTS, 1, 0)
    with pytest.raises(RuntimeError, match="wake"):
        generator.update_weights({"x": torch.ones(1)}, 1, True)
    generator.wake()
    generator.wake()
    generator.generate(PROMPTS, 1, 0)
    assert [c[0] for c in engine.calls] == ["release_memory_occupation", "resume_memory_occupation", "generate"]
    never = FakeSGLangEngine()
    generator = make_generator(never, sleep=False)
    generator.sleep()
    generator.wake()
    assert never.calls == []


def test_seeds_reproduce_samples_only_with_deterministic_inference():
    """Each sample's seed is sent either way; SGLang (and the fake) honours it only when the engine
    was started with `enable_deterministic_inference`, which `sglang(deterministic = true)` asks for."""
    assert se.SGLangOptions(deterministic=True).engine_kwargs("/m", seed=1)["enable_deterministic_inference"]
    assert "enable_deterministic_inference" not in se.SGLangOptions().engine_kwargs("/m", seed=1)
    runs = {}
    for deterministic in (True, False):
        batches = [make_generator(deterministic=deterministic).generate(PROMPTS, samples_per_prompt=2, seed=3)
                   for _ in range(2)]
        runs[deterministic] = torch.equal(batches[0]["response_ids"], batches[1]["response_ids"])
    assert runs == {True: True, False: False}


@pytest.mark.parametrize(("sleep", "saver", "backup"), [(True, True, True), (1, True, True), (2, True, False),
                                                       (False, False, None)])
def test_engine_arguments_follow_the_options(sleep, saver, backup):
    kwargs = se.SGLangOptions(tp=2, gpu_memory=0.5, sleep=sleep, max_model_len=2048).engine_kwargs("/m", seed=1)
    assert kwargs["tp_size"] == 2 and kwargs["mem_fraction_static"] == 0.5 and kwargs["dtype"] == "bfloat16"
    assert kwargs["context_length"] == 2048 and kwargs["random_seed"] == 1 and kwargs["skip_tokenizer_init"]
    assert kwargs["enable_memory_saver"] is saver and kwargs.get("enable_weights_cpu_backup") is backup


def test_greedy_uses_temperature_zero():
    engine = FakeSGLangEngine()
    texts = make_generator(engine).generate_greedy(PROMPTS)
    assert len(texts) == 2 and all(p["temperature"] == 0.0 for p in calls(engine, "generate")[0][2])


def test_logprob_engine_reads_the_response_positions_of_input_logprobs():
    engine = FakeSGLangEngine()
    scorer = se.SGLangLogprob(engine, FakeTokenizer(), se.SGLangOptions())
    batch = {"prompt_ids": torch.tensor([[0, 1, 11], [1, 12, 13]]),
             "prompt_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
             "response_ids": torch.tensor([[20, 21, 0], [22, 0, 0]]),
             "response_mask": torch.tensor([[1, 1, 0], [1, 0, 0]])}
    values = scorer.logprobs(batch)
    (_, inputs, params, return_logprob, start), = calls(engine, "generate")
    assert inputs == [[1, 11, 20, 21], [1, 12, 13, 22]] and return_logprob and start == 0
    assert all(p["max_new_tokens"] == 1 for p in params)
    assert torch.allclose(values, torch.tensor([[-0.2, -0.21, 0.0], [-0.22, 0.0, 0.0]]))


# -- the compiler --------------------------------------------------------------------------


def test_a_gpu_cluster_plans_one_actor_per_sglang_replica():
    text = GPU_CLUSTER.replace("engine = vllm(tp = 2", "engine = sglang(tp = 2")
    result = compile_source(text)
    assert result.ok, result.diagnostics
    rollout = result.plan.pipelines[0].stage("rollout")
    assert rollout.engine.name == "sglang" and rollout.engine.args["sleep"] == 1
    assert [len(r.gpus) for r in rollout.ranks] == [2, 2, 2, 2]  # four replicas, one actor each
    reserved = [(size, gpu.capacity) for gpu in result.memory for name, size in gpu.by_stage
                if name.endswith("/rollout")]
    assert len(reserved) == 8 and all(size == pytest.approx(0.85 * capacity) for size, capacity in reserved)


def test_the_factory_passes_the_plans_engine_arguments():
    from rldsl.runtime.engines import factory

    result = compile_source(GPU_CLUSTER.replace("engine = vllm(tp = 2", "engine = sglang(tp = 2"))
    options = factory._sglang_options(result.plan.pipelines[0].stage("rollout"))
    assert options == se.SGLangOptions(tp=2, gpu_memory=0.85, sleep=1, max_model_len=4096, dtype="bf16")
    text = GPU_CLUSTER.replace("engine = vllm(tp = 2", "engine = sglang(deterministic = true, tp = 2")
    options = factory._sglang_options(compile_source(text).plan.pipelines[0].stage("rollout"))
    assert options.deterministic and options.engine_kwargs("/m", seed=0)["enable_deterministic_inference"]


def test_sglang_is_rejected_without_gpus_and_for_training():
    cpu = BASE.replace("gpus_per_node = 4", "gpus_per_node = 0").replace("  gpus = 2\n", "") \
        .replace("  samples_per_prompt = 4", "  engine = sglang\n  samples_per_prompt = 4")
    assert "needs GPUs" in " ".join(d.message for d in compile_source(cpu).diagnostics if d.code == "RLP108")
    train = BASE.replace("  gpus = 2\n  prompts_per_step", "  engine = sglang(tp = 2)\n  gpus = 2\n  prompts_per_step")
    assert "RLP108" in {d.code for d in compile_source(train).diagnostics}


def test_sglang_sleep_level_two_needs_a_sync_like_vllm():
    text = BASE.replace("  gpus = 2\n  prompts_per_step", "  colocate = rollout\n  prompts_per_step") \
        .replace("  samples_per_prompt = 4", "  engine = sglang(sleep = 2)\n  samples_per_prompt = 4")
    assert "RLP504" not in {d.code for d in compile_source(text).diagnostics}
    unsynced = text.replace("stage sync weights { from = actor  to = rollout }\n", "")
    assert any(d.code == "RLP504" and "level 2" in d.message for d in compile_source(unsynced).diagnostics)


HAS_SGLANG = importlib.util.find_spec("sglang") is not None


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_SGLANG and torch.cuda.is_available()), reason="needs SGLang on a CUDA GPU")
def test_sglang_generates_with_behaviour_logprobs(tmp_path):
    from tests.hf_tiny import save_char_llama

    path = save_char_llama(tmp_path, seed=0, hidden_size=128, intermediate_size=256, num_attention_heads=2,
                           num_key_value_heads=2, max_position_embeddings=256)
    options = se.SGLangOptions(gpu_memory=0.3, dtype="fp32", max_model_len=256)
    generator = se.SGLangGenerator.from_path(str(path), options, seed=0, max_new_tokens=8)
    batch = generator.generate(PROMPTS, samples_per_prompt=4, seed=1)
    assert batch["version"].tolist() == [0] * 8 and batch["behaviour_logprobs"].shape == batch["response_ids"].shape
