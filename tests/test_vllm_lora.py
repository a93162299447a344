"""LoRA adapters served by real vLLM (its CPU build): a torch trainer trains
rank-8 adapters on a tiny Llama, pushes only them, and vLLM serves each
version as an adapter of its own, with behaviour logprobs equal to the
trainer's on the same weights; one vLLM serves two pipelines' adapters side
by side (`served_by`), each at its own version. vLLM with `enable_lora` is an
engine of its own here: the shared engine reloads whole models in place."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from rldsl.plan import LoraPlan
from rldsl.runtime.protocols import Prompt
from tests.vllm_engines import MAX_NEW_TOKENS, TEMPERATURE, needs_vllm

PROMPTS = [Prompt(0, "12+7=", "19"), Prompt(1, "3+45=", "48")]
LORA = LoraPlan(rank=8, alpha=16.0, targets=["q_proj", "v_proj"])


@pytest.fixture(scope="module")
def lora_vllm(tmp_path_factory):
    from rldsl.runtime.engines.vllm import VLLMGenerator, VLLMOptions
    from tests.hf_tiny import save_char_llama

    model_dir = save_char_llama(tmp_path_factory.mktemp("lora-model"), seed=0, hidden_size=128,
                                intermediate_size=256, num_attention_heads=2, num_key_value_heads=2,
                                max_position_embeddings=128)
    options = VLLMOptions(kv_cache=128 << 20, dtype="fp32", max_model_len=128, sleep=False, lora_rank=LORA.rank,
                          lora_alpha=LORA.alpha, lora_targets=tuple(LORA.targets), served_lora_ranks=(LORA.rank,))
    generator = VLLMGenerator.from_path(str(model_dir), options, seed=0, max_new_tokens=MAX_NEW_TOKENS,
                                        temperature=TEMPERATURE)
    yield generator, model_dir
    generator.llm.shutdown()


def lora_trainer(model_dir):
    from rldsl.models import load_model
    from rldsl.models.lora import add_lora
    from rldsl.runtime.engines.torch.train import TorchTrainer

    model = add_lora(load_model(f"hf:{model_dir}"), LORA, seed=0)
    return TorchTrainer(model, lr=5e-2, temperature=TEMPERATURE)


def train_step(trainer, batch, step: int):
    batch = {**batch, "advantage": torch.linspace(-1.0, 1.0, batch["response_ids"].shape[0])}
    trainer.begin_train_step(step)
    trainer.train_microbatch(step, batch)
    return trainer.finish_train_step(step)


def push(generator, trainer, version: int) -> None:
    buckets = list(trainer.weight_buckets(1 << 14))  # several buckets, as a push of a larger model
    for index, bucket in enumerate(buckets):
        generator.update_weights(bucket, version, index == len(buckets) - 1)


def logprob_gap(generator, trainer, seed: int) -> tuple[float, object]:
    """|vLLM's behaviour logprobs - the trainer's| on a fresh group, and the group."""
    from rldsl.runtime.engines.torch.common import response_logprobs

    batch = generator.generate(PROMPTS, samples_per_prompt=4, seed=seed)
    with torch.no_grad():
        expected = response_logprobs(trainer.model, batch, TEMPERATURE)
    mask = batch["response_mask"].bool()
    return float((batch["behaviour_logprobs"] - expected)[mask].abs().max()), batch


@needs_vllm
def test_vllm_serves_each_pushed_adapter_version_with_the_trainers_logprobs(lora_vllm):
    generator, model_dir = lora_vllm
    trainer = lora_trainer(model_dir)
    before, batch = logprob_gap(generator, trainer, seed=1)
    assert before < 1e-4 and generator.adapter is None  # version 0: the base, which the fresh adapters equal

    for version in (1, 2):
        assert train_step(trainer, batch, version - 1).version == version
        stale, _ = logprob_gap(generator, trainer, seed=1)
        assert stale > 1e-3, stale  # the trainer moved: vLLM lags until the push
        push(generator, trainer, version)
        assert generator.version == version == generator.llm.current_version()
        assert generator.adapter.lora_int_id == version  # the engine's first adapters: ids 1, 2
        gap, batch = logprob_gap(generator, trainer, seed=1 + version)
        print(f"|vLLM - torch| logprob with LoRA version {version}, fp32 CPU: max {gap:.2e}")
        assert gap < 1e-4
        assert batch["version"].tolist() == [version] * 8
    assert set(generator.llm.loop.run(generator.llm.engine.list_loras())) == {2}  # the older version was removed
    assert len(generator.generate_greedy(PROMPTS)) == 2  # evaluation on the generators runs on the adapter too


@needs_vllm
def test_one_vllm_serves_two_pipelines_adapters_side_by_side_each_at_its_own_version(lora_vllm):
    generator, model_dir = lora_vllm  # at version 2 (the test above)
    served = generator.serving("b", generator.options, max_new_tokens=MAX_NEW_TOKENS, temperature=TEMPERATURE)
    mine, theirs = lora_trainer(model_dir), lora_trainer(model_dir)
    _, batch = logprob_gap(generator, mine, seed=1)
    for step in range(3):
        train_step(mine, batch, step)
    train_step(theirs, batch, 0)  # another pipeline: other adapters (version 1 against 3)
    push(generator, mine, 3)
    push(served, theirs, 1)
    assert (generator.version, served.version) == (3, 1)
    # one group of each pipeline in flight at once, batched together by vLLM, each on its own adapter
    groups = [engine.start_group((PROMPTS, 4, 11)) for engine in (generator, served)]
    ours, others = (group.result() for group in groups)
    mask = ours["response_mask"].bool()
    from rldsl.runtime.engines.torch.common import response_logprobs

    with torch.no_grad():
        assert float((ours["behaviour_logprobs"] - response_logprobs(mine.model, ours, TEMPERATURE))[mask]
                     .abs().max()) < 1e-4
        gap = others["behaviour_logprobs"] - response_logprobs(theirs.model, others, TEMPERATURE)
        wrong = others["behaviour_logprobs"] - response_logprobs(mine.model, others, TEMPERATURE)
    mask = others["response_mask"].bool()
    assert float(gap[mask].abs().max()) < 1e-4 < float(wrong[mask].abs().max())
    assert ours["version"].tolist() == [3] * 8 and others["version"].tolist() == [1] * 8
    assert len(set(generator.llm.loop.run(generator.llm.engine.list_loras()))) == 2
    assert served.adapter.lora_name == "rldsl-b-v1" and generator.adapter.lora_name == "rldsl-v3"


@needs_vllm
def test_a_push_with_weights_that_are_no_adapters_is_refused(lora_vllm):
    generator, model_dir = lora_vllm
    from rldsl.models import load_model

    whole = load_model(f"hf:{model_dir}").module.state_dict()
    with pytest.raises(ValueError, match="no adapters"):
        generator.update_weights(dict(list(whole.items())[:2]), generator.version + 1, True)


def test_a_vllm_generator_of_a_lora_model_starts_vllm_with_adapters_of_its_rank():
    from rldsl.runtime.engines import factory
    from rldsl.runtime.engines.vllm import VLLMOptions
    from rldsl.runtime.engines.vllm_lora import lora_rank_served
    from tests.test_lora import planned, stage

    pipe = planned().pipelines[0]
    generate = stage(pipe, "generate")
    engine = replace(generate.engine, name="vllm", args={"tp": 1, "gpu_memory": 0.5, "sleep": False, "dtype": "fp32"})
    vllm = factory._vllm_options(replace(generate, engine=engine), pipe.models[0].lora)
    assert (vllm.lora_rank, vllm.lora_alpha, vllm.lora_targets) == (8, 16.0, ("qkv", "out"))
    args = vllm.engine_args("/m", seed=0)
    assert args["enable_lora"] and args["max_lora_rank"] == 8 and args["max_loras"] == 1
    serving = factory._vllm_options(replace(generate, engine=engine), pipe.models[0].lora,
                                    serves=(replace(pipe.models[0].lora, rank=16),) * 2).engine_args("/m", seed=0)
    assert (serving["max_loras"], serving["max_cpu_loras"], serving["max_lora_rank"]) == (3, 6, 16)
    assert "enable_lora" not in VLLMOptions().engine_args("/m", seed=0)
    assert [lora_rank_served(r) for r in (1, 4, 8, 12, 64)] == [1, 8, 8, 16, 64]
    with pytest.raises(ValueError, match="up to 512"):
        lora_rank_served(1024)


@needs_vllm
def test_an_architecture_vllm_serves_no_adapters_for_is_named_before_the_engine_starts(tmp_path):
    import json

    from rldsl.runtime.engines.vllm import VLLMOptions, start_engine
    from rldsl.runtime.engines.vllm_lora import lora_unsupported

    for architecture in ("GPT2LMHeadModel", "LlamaForCausalLM"):
        (tmp_path / architecture).mkdir()
        (tmp_path / architecture / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    assert lora_unsupported(str(tmp_path / "LlamaForCausalLM")) is None
    assert "does not serve LoRA adapters for GPT2LMHeadModel" in lora_unsupported(str(tmp_path / "GPT2LMHeadModel"))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):  # before anything starts
        start_engine(str(tmp_path / "GPT2LMHeadModel"), VLLMOptions(lora_rank=8), seed=0)
