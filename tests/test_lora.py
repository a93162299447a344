"""LoRA (`lora_rank` on a model): only the adapters train, are pushed and are
checkpointed; generators and policy logprob stages hold the same adapters,
a frozen reference the base alone; engines that cannot are refused (RLP118)."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rldsl.compiler import memory_model
from rldsl.compiler.driver import compile_source
from rldsl.compiler.memory import BUILTIN_SHAPES
from rldsl.launch_rules import plan_refusals
from rldsl.models.lora import has_adapters, is_adapter, trained_state
from rldsl.plan import ExecutionPlan, LoraPlan
from rldsl.runtime.engines.factory import build_generator, build_logprob, build_trainer
from rldsl.runtime.engines.torch.common import response_logprobs

PIPELINE = Path(__file__).parent.parent / "pipelines" / "grpo_lora.rlp"


def planned(text: str | None = None):
    result = compile_source(text or PIPELINE.read_text(), str(PIPELINE), base_dir=PIPELINE.parent)
    assert result.ok, [d.message for d in result.diagnostics if d.is_error]
    return result.plan


def stage(pipe, kind):
    return next(s for s in pipe.stages if s.kind == kind)


def test_a_model_with_a_lora_rank_plans_its_adapters_and_an_older_plan_has_none():
    plan = planned()
    assert plan.pipelines[0].models[0].lora == LoraPlan(rank=8, alpha=16.0, targets=["qkv", "out"])
    assert ExecutionPlan.from_json(plan.to_json()).pipelines[0].models[0].lora == plan.pipelines[0].models[0].lora
    defaults = planned(PIPELINE.read_text().replace('  lora_targets = ["qkv", "out"]\n', "")
                       .replace("lora_rank = 8", "lora_rank = 4"))
    assert defaults.pipelines[0].models[0].lora == LoraPlan(rank=4, alpha=8.0, targets=["qkv", "out"])
    old = json.loads(plan.to_json())
    del old["pipelines"][0]["models"][0]["lora"]  # a plan saved before LoRA existed
    assert ExecutionPlan.from_json(json.dumps(old)).pipelines[0].models[0].lora is None


def batch_for(model, rows: int = 8) -> dict:
    gen = torch.Generator().manual_seed(5)
    vocab = model.tokenizer.vocab_size
    batch = {"prompt_ids": torch.randint(4, vocab, (rows, 6), generator=gen),
             "prompt_mask": torch.ones(rows, 6, dtype=torch.long),
             "response_ids": torch.randint(4, vocab, (rows, 5), generator=gen),
             "response_mask": torch.ones(rows, 5, dtype=torch.long)}
    with torch.no_grad():
        current = response_logprobs(model, batch)
    batch["behaviour_logprobs"] = current.clone()
    batch["ref_logprobs"] = current.clone()
    batch["advantage"] = torch.randn(rows, generator=gen)
    return batch


def trained(trainer, steps: int = 2):
    batch = batch_for(trainer.model)
    for step in range(steps):
        trainer.begin_train_step(step)
        trainer.train_microbatch(step, batch)
        result = trainer.finish_train_step(step)
    return result


def test_the_trainer_trains_and_pushes_only_the_adapters_and_a_generator_applies_them():
    pipe = planned().pipelines[0]
    trainer = build_trainer(stage(pipe, "train"), pipe, seed=0)
    module = trainer.model.module
    base = {name: tensor.clone() for name, tensor in module.state_dict().items() if not is_adapter(name)}
    adapters = {name: tensor.clone() for name, tensor in trained_state(module).items()}
    assert adapters and all(p.requires_grad == is_adapter(n) for n, p in module.named_parameters())
    result = trained(trainer)
    assert result.version == 2
    assert all(torch.equal(module.state_dict()[name], tensor) for name, tensor in base.items())  # base untouched
    assert any(not torch.equal(trained_state(module)[name], tensor) for name, tensor in adapters.items())

    buckets = list(trainer.weight_buckets(1 << 20))
    pushed = {name: tensor for bucket in buckets for name, tensor in bucket.items()}
    assert set(pushed) == set(adapters)  # only the adapters travel
    pushed_bytes = sum(t.numel() * t.element_size() for t in pushed.values())
    full_bytes = sum(t.numel() * t.element_size() for t in base.values())
    assert result.metrics["push_bytes"] == pushed_bytes < 0.06 * full_bytes, (pushed_bytes, full_bytes)  # 5.7%
    # the memory model counts the adapters the trainer really holds
    assert 4 * memory_model.lora_params(BUILTIN_SHAPES["tiny-lm"], 8, ["qkv", "out"]) == pushed_bytes

    generator = build_generator(stage(pipe, "generate"), pipe, seed=0)
    batch = batch_for(trainer.model)
    assert not torch.allclose(response_logprobs(generator.model, batch), response_logprobs(trainer.model, batch))
    for index, bucket in enumerate(buckets):
        generator.update_weights(bucket, result.version, index == len(buckets) - 1)
    assert generator.version == 2
    assert torch.equal(response_logprobs(generator.model, batch), response_logprobs(trainer.model, batch))

    reference = build_logprob(next(s for s in pipe.stages if s.kind == "logprob"), pipe, seed=0)
    assert not has_adapters(reference.model.module)  # frozen: the base, the policy with its adapters off


def test_a_checkpoint_holds_the_adapters_and_their_optimizer_state_and_resumes_them(tmp_path):
    pipe = planned().pipelines[0]
    trainer = build_trainer(stage(pipe, "train"), pipe, seed=0)
    trained(trainer)
    trainer.save_checkpoint(tmp_path)
    saved = torch.load(tmp_path / "torch.pt", weights_only=False)
    assert set(saved["model"]) == set(trained_state(trainer.model.module)) and all(map(is_adapter, saved["model"]))

    resumed = build_trainer(stage(pipe, "train"), pipe, seed=1)  # other initial adapters
    assert resumed.load_checkpoint(tmp_path) == 2
    for name, tensor in trained_state(trainer.model.module).items():
        assert torch.equal(trained_state(resumed.model.module)[name], tensor)
    mine, theirs = trainer.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k]["exp_avg"], theirs[k]["exp_avg"]) for k in mine)

    full = build_trainer(replace(stage(pipe, "train")), replace(pipe, models=[replace(pipe.models[0], lora=None)]),
                         seed=0)
    with pytest.raises(RuntimeError):  # a full-parameter trainer cannot take an adapter checkpoint
        full.load_checkpoint(tmp_path)
    other = replace(pipe, models=[replace(pipe.models[0], lora=LoraPlan(4, 8.0, ["qkv"]))])
    with pytest.raises(ValueError, match="other `lora_rank` / `lora_targets`"):
        build_trainer(stage(other, "train"), other, seed=0).load_checkpoint(tmp_path)


def test_targets_that_match_no_layer_name_the_model_layers():
    pipe = planned().pipelines[0]
    wrong = replace(pipe, models=[replace(pipe.models[0], lora=LoraPlan(4, 8.0, ["q_proj"]))])
    with pytest.raises(ValueError, match="names no linear layer.*qkv, out"):
        build_trainer(stage(wrong, "train"), wrong, seed=0)


def test_a_hand_made_plan_with_adapters_where_they_cannot_be_is_refused_by_the_launcher():
    plan = planned()
    pipe = plan.pipelines[0]

    def refused(kind: str, engine: str, **settings) -> list[str]:
        target = stage(pipe, kind)
        changed = replace(target, engine=replace(target.engine, name=engine),
                          settings={**target.settings, **settings})
        edited = replace(pipe, stages=[changed if s is target else s for s in pipe.stages])
        return [str(r) for r in plan_refusals(replace(plan, pipelines=[edited])) if r.code == "RLP118"]

    assert refused("generate", "vllm") == []  # vLLM serves them per request
    assert "cannot land a version mid-response" in refused("generate", "vllm", update="interrupt")[0]
    generate = stage(pipe, "generate")
    asleep = replace(generate, engine=replace(generate.engine, name="vllm", args={**generate.engine.args, "sleep": 2}))
    edited = replace(pipe, stages=[asleep if s is generate else s for s in pipe.stages])
    assert any("nothing would restore the base" in str(r) for r in plan_refusals(replace(plan, pipelines=[edited])))
    assert "`sglang` cannot serve them" in refused("generate", "sglang")[0]
    assert "`megatron` cannot train them" in refused("train", "megatron")[0]
    assert refused("train", "fsdp") == []  # fsdp trains them
    assert refused("logprob", "vllm") == []  # the frozen reference: the base, on any engine
    assert "`fsdp` cannot serve them" in refused("logprob", "fsdp", frozen=False)[0]  # a policy logprob stage


# -- export: the merged model, and PEFT's adapter directory for an hf: base -----------------------------


def lora_run(run_dir: Path, text: str):
    """A LoRA run of ``text`` checkpointed after two steps, as `rldsl run` leaves it; and its trainer."""
    from tests.test_export import make_run_dir, mark_complete, trainer_dir

    make_run_dir(run_dir, text)
    pipe = ExecutionPlan.from_json((run_dir / "plan.json").read_text()).pipelines[0]
    trainer = build_trainer(stage(pipe, "train"), pipe, seed=0)
    trained(trainer)
    trainer.save_checkpoint(trainer_dir(run_dir, 2))
    mark_complete(run_dir, 2, "torch")
    return trainer


def test_a_lora_run_exports_the_merged_model_with_the_policy_logits(tmp_path):
    from tests.test_export import assert_same_logits, export, rldsl_logits, token_rows

    trainer = lora_run(tmp_path / "run", PIPELINE.read_text().replace("lr = 5e-3", "lr = 5e-2"))
    assert export(tmp_path / "run", tmp_path / "hf") == 0
    ids = token_rows(trainer.model.tokenizer)
    policy = rldsl_logits(trainer.model, ids)
    base = build_trainer(stage(planned().pipelines[0], "train"), planned().pipelines[0], seed=0).model
    assert not torch.allclose(rldsl_logits(base, ids), policy, atol=1e-3)  # the adapters moved it
    assert_same_logits(tmp_path / "hf", ids, policy)
    assert not (tmp_path / "hf" / "adapter").exists()  # a builtin base has no directory PEFT could name


def test_an_hf_lora_run_exports_its_peft_adapter_and_with_merge_the_merged_model(tmp_path, capsys):
    import transformers
    from peft import PeftModel

    from tests.test_export import assert_same_logits, export, hf_llama, pipeline_text, rldsl_logits, token_rows

    source = hf_llama(tmp_path / "source")
    text = pipeline_text(f"hf:{source}").replace(f'source = "hf:{source}"',
                                                 f'source = "hf:{source}"  lora_rank = 4')
    trainer = lora_run(tmp_path / "run", text.replace("lr = 5e-4", "lr = 5e-2"))
    assert trainer.model.lora.targets == ["q_proj", "v_proj"]  # the default for Hugging Face models
    ids = token_rows(trainer.model.tokenizer)
    policy = rldsl_logits(trainer.model, ids)
    assert export(tmp_path / "run", tmp_path / "adapter") == 0  # the adapter alone, by default
    assert "PeftModel.from_pretrained" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["adapter_config.json",
                                                                        "adapter_model.safetensors"]
    assert export(tmp_path / "run", tmp_path / "hf", "--merge") == 0
    assert_same_logits(tmp_path / "hf", ids, policy)
    for adapter in (tmp_path / "adapter", tmp_path / "hf" / "adapter"):
        assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(source)
        base = transformers.AutoModelForCausalLM.from_pretrained(source, local_files_only=True)
        with torch.no_grad():
            assert not torch.allclose(base(ids).logits, policy, atol=1e-3)
            peft_logits = PeftModel.from_pretrained(base, adapter)(ids).logits
        assert torch.allclose(peft_logits, policy, atol=1e-5), float((peft_logits - policy).abs().max())


def test_check_refuses_interrupting_updates_on_a_vllm_generator_serving_adapters():
    text = PIPELINE.read_text().replace('source = "builtin:tiny-lm"', 'source = "hf:/models/llama"  params = 8B')
    text = text.replace('  lora_targets = ["qkv", "out"]\n', "").replace("  engine = torch\n  gpus = 1\n  samples",
                                                                           "  engine = vllm\n  gpus = 1\n  samples")
    assert "engine = vllm" in text

    def findings(source: str) -> list:
        result = compile_source(source, str(PIPELINE), base_dir=PIPELINE.parent)
        return [d for d in result.diagnostics if d.code == "RLP118"]

    assert findings(text) == []
    interrupting = findings(text.replace("  temperature = 1.0\n", "  temperature = 1.0\n  update = interrupt\n"))
    assert len(interrupting) == 1 and "mid-response" in interrupting[0].message
    assert interrupting[0].help == "set `update = between_requests` (the default)"
    discarding = findings(text.replace("  engine = vllm\n", "  engine = vllm(sleep = 2)\n"))
    assert len(discarding) == 1 and "nothing would restore the base" in discarding[0].message
    gpt2 = findings(text.replace('source = "hf:/models/llama"  params = 8B', 'source = "builtin:tiny-gpt2"'))
    assert len(gpt2) == 1 and "is a GPT-2, which it does not" in gpt2[0].message  # vLLM has no GPT-2 LoRA


# -- fsdp: the adapters sharded, trained, pushed and checkpointed alone ----------------------------


def on_fsdp(pipe):
    train = stage(pipe, "train")
    fsdp = replace(train, engine=replace(train.engine, name="fsdp", args={"shard": 0, "offload": False,
                                                                           "dtype": "fp32"}))
    return replace(pipe, stages=[fsdp if s is train else s for s in pipe.stages]), fsdp


def full(module) -> dict:
    return {name: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
            for name, t in trained_state(module).items()}


def test_fsdp_trains_the_same_adapters_as_the_torch_trainer_and_checkpoints_them_alone(one_process_group,
                                                                                            tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    pipe = planned().pipelines[0]
    torch_trainer = build_trainer(stage(pipe, "train"), pipe, seed=0)
    fsdp_pipe, fsdp_stage = on_fsdp(pipe)
    fsdp_trainer = build_trainer(fsdp_stage, fsdp_pipe, seed=0)
    assert [n for n, p in fsdp_trainer.model.module.named_parameters() if p.requires_grad] == \
        [n for n, p in torch_trainer.model.module.named_parameters() if p.requires_grad]
    trained(torch_trainer)
    trained(fsdp_trainer)
    expected, got = full(torch_trainer.model.module), full(fsdp_trainer.model.module)
    assert got.keys() == expected.keys()
    assert max(float((got[n] - expected[n]).abs().max()) for n in got) < 1e-5
    pushed = {n: t for b in fsdp_trainer.weight_buckets(1 << 12) for n, t in b.items()}
    assert pushed.keys() == expected.keys()  # only the adapters travel

    fsdp_trainer.save_checkpoint(tmp_path)
    saved = FileSystemReader(tmp_path / "fsdp").read_metadata().state_dict_metadata
    assert {k for k in saved if k.startswith("model.")} == {f"model.{n}" for n in expected}  # no base weight
    resumed = build_trainer(fsdp_stage, fsdp_pipe, seed=1)
    assert resumed.load_checkpoint(tmp_path) == 2
    assert all(torch.equal(full(resumed.model.module)[n], got[n]) for n in got)


def test_fsdp_builds_an_hf_model_with_adapters_on_meta_and_reads_the_base_from_its_files(one_process_group,
                                                                                         tmp_path):
    from rldsl.models import load_model
    from tests.test_export import hf_llama, pipeline_text

    source = hf_llama(tmp_path / "source")
    text = pipeline_text(f"hf:{source}").replace(f'source = "hf:{source}"', f'source = "hf:{source}"  lora_rank = 4')
    pipe, fsdp_stage = on_fsdp(planned(text).pipelines[0])
    trainer = build_trainer(fsdp_stage, pipe, seed=0)
    state = {n: (t.full_tensor() if hasattr(t, "full_tensor") else t) for n, t in
             trainer.model.module.state_dict().items()}
    base = load_model(f"hf:{source}").module.state_dict()
    assert all(torch.equal(state[n.replace("q_proj.", "q_proj.base_layer.").replace("v_proj.", "v_proj.base_layer.")],
                           t) for n, t in base.items())
    adapters = full(trainer.model.module)
    assert adapters and all(not t.any() for n, t in adapters.items() if ".lora_B." in n)  # the base, exactly
    assert all(t.abs().sum() > 0 for n, t in adapters.items() if ".lora_A." in n)


def test_the_launcher_names_peft_when_it_is_missing(monkeypatch):
    import importlib.util

    from rldsl.runtime.ray_lowering.launch import PreflightError, _check_libraries

    pipe = planned().pipelines[0]
    _check_libraries(pipe)  # installed here
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else find_spec(name, *a))
    with pytest.raises(PreflightError, match=r"pip install 'rldsl\[lora\]'"):
        _check_libraries(pipe)


def test_a_colocated_frozen_reference_is_the_trainers_policy_with_its_adapters_off():
    from rldsl.layout import actor_slots

    plan = planned()
    pipe = plan.pipelines[0]
    reference = next(s for s in pipe.stages if s.kind == "logprob")
    assert reference.on_trainer == "actor" and reference.own_ranks == []  # no actor, no copy of the model
    assert [s.name for s in actor_slots(plan)] == ["rollout-0", "actor-0"]
    apart = planned(PIPELINE.read_text().replace("frozen  colocate = actor", "frozen  gpus = 1")
                    .replace("gpus_per_node = 2 ", "gpus_per_node = 3 "))
    assert next(s for s in apart.pipelines[0].stages if s.kind == "logprob").on_trainer is None  # GPUs of its own

    trainer, alone = (build_trainer(stage(pipe, "train"), pipe, seed=0) for _ in range(2))
    base = build_logprob(reference, pipe, seed=0)  # the reference as its own stage would hold it
    batch = batch_for(trainer.model)
    for step in range(2):
        for engine in (trainer, alone):
            engine.begin_train_step(step)
            engine.train_microbatch(step, batch)
        scored = trainer.reference_logprobs(batch)  # between two of the trainer's calls
        assert torch.equal(scored, base.logprobs(batch))
        for engine in (trainer, alone):
            engine.finish_train_step(step)
    # scoring the reference left training as it was: the same adapters as a trainer that never scored
    assert all(torch.equal(a, b) for a, b in zip(trained_state(trainer.model.module).values(),
                                                 trained_state(alone.model.module).values()))
    assert not torch.equal(response_logprobs(trainer.model, batch), base.logprobs(batch))
