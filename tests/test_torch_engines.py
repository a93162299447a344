"""The torch engines: generation, logprobs, weight sync, trainer protocol, learning."""

import pytest
import torch

from rldsl.models import load_model
from rldsl.models.tiny import build_tiny_lm
from rldsl.runtime.control.advantages import batch_advantages
from rldsl.runtime.engines.torch import TorchGenerator, TorchLogprob, TorchTrainer
from rldsl.runtime.engines.torch.common import encode_prompts, positions_from_mask, response_logprobs
from rldsl.runtime.engines.torch.generate import _top_p_filter
from rldsl.runtime.engines.torch.warmstart import (
    WarmStartSettings,
    arith_without_carry,
    load_warm_started,
    reverse_ends_only,
)
from rldsl.runtime.protocols import GenerationEngine, LogprobEngine, Prompt, Trainer
from rldsl.tasks import load_dataset

PROMPTS = [Prompt(0, "12+7=", "19"), Prompt(1, "3+45=", "48"), Prompt(2, "reverse abc:", "cba")]


def small_model(seed=0):
    return build_tiny_lm(seed, d_model=32, n_layers=2, n_heads=2, d_ff=64)


def trained_batch(generator, samples=4, seed=0):
    batch = generator.generate(PROMPTS, samples, seed=seed)
    rewards = torch.randn(len(PROMPTS) * samples, generator=torch.Generator().manual_seed(1))
    batch["advantage"] = batch_advantages(rewards, samples)
    return batch


def test_engines_satisfy_the_protocols():
    model = small_model()
    assert isinstance(TorchGenerator(model), GenerationEngine)
    assert isinstance(TorchLogprob(small_model()), LogprobEngine)
    assert isinstance(TorchTrainer(small_model()), Trainer)


def test_same_seed_same_weights_and_load_model_dispatch():
    a, b = load_model("builtin:tiny-lm", seed=5), load_model("builtin:tiny-lm", seed=5)
    assert all(torch.equal(x, y) for x, y in zip(a.module.state_dict().values(), b.module.state_dict().values()))
    with pytest.raises(ValueError, match="unknown model source"):
        load_model("gpt-17")
    with pytest.raises(FileNotFoundError, match="never downloaded"):
        load_model("hf:/no/such/dir")


def test_generate_layout_masks_and_version():
    generator = TorchGenerator(small_model(), max_new_tokens=6)
    generator.version = 3
    batch = generator.generate(PROMPTS, 4, seed=11)
    rows = len(PROMPTS) * 4
    assert batch["prompt_ids"].shape[0] == rows and batch["response_ids"].shape[1] <= 6
    assert batch["version"].tolist() == [3] * rows
    # prompt-major: rows 0-3 share prompt 0, and prompts are left-padded
    assert torch.equal(batch["prompt_ids"][0], batch["prompt_ids"][3])
    assert batch["prompt_mask"][:, -1].all()
    eos = generator.model.eos_id
    for ids, mask in zip(batch["response_ids"], batch["response_mask"]):
        length = int(mask.sum())
        assert mask[:length].all() and not mask[length:].any()  # a prefix of ones
        assert (ids[length:] == 0).all()
        assert eos not in ids[: length - 1].tolist()  # EOS only as the last real token
    assert (batch["behaviour_logprobs"][batch["response_mask"] == 0] == 0).all()
    again = generator.generate(PROMPTS, 4, seed=11)
    assert all(torch.equal(batch[name], again[name]) for name in batch)


def test_behaviour_logprobs_equal_trainer_and_logprob_engine():
    model = small_model()
    generator = TorchGenerator(model, max_new_tokens=6)
    batch = generator.generate(PROMPTS, 4, seed=2)
    policy = TorchLogprob(small_model())
    assert torch.equal(policy.logprobs(batch), batch["behaviour_logprobs"])
    trainer_view = response_logprobs(small_model(), batch)  # what the trainer computes
    ratio = torch.exp(trainer_view - batch["behaviour_logprobs"])
    assert torch.equal(ratio, torch.ones_like(ratio))


def test_kv_cache_decoding_matches_full_forward():
    model = small_model()
    ids, mask = encode_prompts(model.tokenizer, [Prompt(0, "12+7=", ""), Prompt(1, "reverse abcd:", "")])
    full_ids = torch.cat([ids, torch.randint(4, 40, (2, 3))], dim=1)
    full_mask = torch.ones_like(full_ids)
    full_mask[:, : ids.shape[1]] = mask
    with torch.no_grad():
        full_logits, _ = model.forward(full_ids, full_mask, positions_from_mask(full_mask))
        logits, cache = model.forward(ids, mask, positions_from_mask(mask))
        steps = [logits[:, -1]]
        positions = positions_from_mask(full_mask)
        for t in range(ids.shape[1], full_ids.shape[1] - 1):
            logits, cache = model.forward(full_ids[:, t : t + 1], full_mask[:, : t + 1], positions[:, t : t + 1], cache)
            steps.append(logits[:, -1])
    incremental = torch.stack(steps, dim=1)
    expected = full_logits[:, ids.shape[1] - 1 : -1]
    assert torch.allclose(incremental, expected, atol=1e-5)


def test_greedy_is_temperature_zero_sampling():
    model = small_model()
    greedy = TorchGenerator(model, max_new_tokens=5).generate_greedy(PROMPTS)
    cold = TorchGenerator(model, max_new_tokens=5, temperature=0.0)
    assert cold.decode(cold.generate(PROMPTS, 1, seed=0)) == greedy


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    expected = {0.5: [0.5, 0, 0, 0], 0.7: [0.5, 0.3, 0, 0], 0.85: [0.5, 0.3, 0.15, 0], 1.0: [0.5, 0.3, 0.15, 0.05]}
    for top_p, kept in expected.items():
        assert torch.allclose(_top_p_filter(probs, top_p), torch.tensor([kept])), top_p


def test_a_checkpoint_resumes_the_same_next_step(tmp_path):
    """save after step 0, a fresh trainer loads it: step 1 is identical (AdamW moments included)."""
    batch = trained_batch(TorchGenerator(small_model(seed=1), max_new_tokens=4))

    def step(trainer, index):
        trainer.begin_train_step(index)
        trainer.train_microbatch(index, batch)
        return trainer.finish_train_step(index)

    trainer = TorchTrainer(small_model(seed=1), lr=1e-2)
    step(trainer, 0)
    trainer.save_checkpoint(tmp_path)
    expected = step(trainer, 1)
    resumed = TorchTrainer(small_model(seed=5), lr=1e-2)
    assert resumed.load_checkpoint(tmp_path) == 1
    assert step(resumed, 1).version == expected.version == 2
    for name, tensor in trainer.model.module.state_dict().items():
        assert torch.equal(resumed.model.module.state_dict()[name], tensor), name
    trainer.begin_train_step(2)
    with pytest.raises(RuntimeError, match="open"):
        trainer.save_checkpoint(tmp_path)


def test_weight_sync_in_buckets_is_exact_and_versioned():
    trainer = TorchTrainer(small_model(seed=1), lr=1e-2)
    generator = TorchGenerator(small_model(seed=2), max_new_tokens=4)
    batch = trained_batch(TorchGenerator(small_model(seed=1), max_new_tokens=4))
    trainer.begin_train_step(0)
    trainer.train_microbatch(0, batch)
    version = trainer.finish_train_step(0).version
    buckets = list(trainer.weight_buckets(bucket_bytes=4096))
    assert len(buckets) > 3
    names = [name for bucket in buckets for name in bucket]
    assert sorted(names) == sorted(trainer.model.module.state_dict())
    for index, bucket in enumerate(buckets):
        last = index == len(buckets) - 1
        generator.update_weights(bucket, version, last)
        if not last:
            assert generator.version == 0
            with pytest.raises(RuntimeError, match="in progress"):
                generator.generate(PROMPTS, 2, seed=0)
    assert generator.version == version == 1
    for name, tensor in trainer.model.module.state_dict().items():
        assert torch.equal(generator.model.module.state_dict()[name], tensor), name


def test_weight_buckets_size_rules_and_bad_updates():
    trainer = TorchTrainer(small_model())
    limit = trainer.model.module.token_embedding.weight.numel() * 4 - 1
    buckets = list(trainer.weight_buckets(bucket_bytes=limit))
    assert [len(b) for b in buckets if "token_embedding.weight" in b] == [1]  # too big: travels alone
    for bucket in buckets:
        assert len(bucket) == 1 or sum(t.numel() * 4 for t in bucket.values()) <= limit
    generator = TorchGenerator(small_model())
    with pytest.raises(KeyError, match="not in this engine"):
        generator.update_weights({"nope": torch.zeros(1)}, 1, True)
    generator.update_weights(buckets[0], 1, last=False)
    with pytest.raises(RuntimeError, match="half applied"):
        generator.update_weights(buckets[0], 2, last=True)


def test_sleep_and_wake_are_noops_on_cpu():
    generator = TorchGenerator(small_model())
    before = generator.generate_greedy(PROMPTS)
    generator.sleep()
    generator.wake()
    assert generator.model.device.type == "cpu" and generator.generate_greedy(PROMPTS) == before


def test_trainer_protocol_invariants():
    trainer = TorchTrainer(small_model())
    batch = trained_batch(TorchGenerator(small_model(), max_new_tokens=4))
    with pytest.raises(RuntimeError, match="without an open step"):
        trainer.train_microbatch(0, batch)
    with pytest.raises(RuntimeError, match="without an open step"):
        trainer.finish_train_step(0)
    trainer.begin_train_step(0)
    with pytest.raises(RuntimeError, match="while step 0 is open"):
        trainer.begin_train_step(1)
    with pytest.raises(RuntimeError, match="open step is 0"):
        trainer.train_microbatch(1, batch)
    trainer.train_microbatch(0, batch)
    with pytest.raises(RuntimeError, match="open step is 0"):
        trainer.finish_train_step(1)
    weights = [p.detach().clone() for p in trainer.parameters]
    trainer.abort_train_step(0)
    trainer.abort_train_step(0)  # idempotent
    trainer.abort_train_step(7)  # nothing open: still fine
    assert all(p.grad is None for p in trainer.parameters)
    assert trainer.version == 0 and all(torch.equal(w, p) for w, p in zip(weights, trainer.parameters))
    trainer.begin_train_step(1)  # clean state: a new step can open
    result = trainer.finish_train_step(1)  # empty step: closes, no optimizer step
    assert result.version == 0 and result.metrics == {"skipped": 1.0}
    trainer.begin_train_step(2)
    trainer.train_microbatch(2, batch)
    assert trainer.finish_train_step(2).version == trainer.version == 1


def test_few_grpo_steps_raise_mean_reward():
    """A random-init model learns to write '7's when rewarded for them."""
    torch.manual_seed(0)
    model = small_model(seed=4)
    generator = TorchGenerator(small_model(seed=4), max_new_tokens=4)
    trainer = TorchTrainer(model, lr=1e-2)
    prompts = load_dataset("builtin:arith", "train", seed=0)[:8]
    sevens = lambda text: text.count("7") / 4  # noqa: E731

    def mean_reward(batch):
        return sum(map(sevens, generator.decode(batch))) / len(batch["version"])

    rewards = []
    for step in range(15):
        batch = generator.generate(prompts, 8, seed=step)
        batch["advantage"] = batch_advantages(torch.tensor([sevens(t) for t in generator.decode(batch)]), 8)
        rewards.append(mean_reward(batch))
        trainer.begin_train_step(step)
        trainer.train_microbatch(step, batch)
        version = trainer.finish_train_step(step).version
        buckets = list(trainer.weight_buckets(1 << 20))
        for index, bucket in enumerate(buckets):
            generator.update_weights(bucket, version, index == len(buckets) - 1)
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.3, rewards


def test_careless_teachers():
    assert arith_without_carry(Prompt(0, "58+67=", "125")) == "15"
    assert arith_without_carry(Prompt(0, "12+7=", "19")) == "19"
    assert reverse_ends_only(Prompt(0, "reverse abcd:", "dcba")) == "dbca"


def test_warm_start_is_cached_and_deterministic(tmp_path, monkeypatch):
    settings = WarmStartSettings(max_learn_steps=20, max_habit_steps=10, check_every=10, check_prompts=16)
    overrides = {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64}
    monkeypatch.setenv("RLDSL_CACHE_DIR", str(tmp_path / "a"))
    first = load_warm_started("builtin:arith", seed=0, model_overrides=overrides, settings=settings)
    files = list((tmp_path / "a" / "warmstart").glob("*.pt"))
    assert len(files) == 1 and first.warm_start_report["learn"]["steps"] == 20
    again = load_warm_started("builtin:arith", seed=0, model_overrides=overrides, settings=settings)
    monkeypatch.setenv("RLDSL_CACHE_DIR", str(tmp_path / "b"))
    fresh = load_warm_started("builtin:arith", seed=0, model_overrides=overrides, settings=settings)
    untrained = build_tiny_lm(0, **overrides)
    for name, tensor in first.module.state_dict().items():
        assert torch.equal(tensor, again.module.state_dict()[name])
        assert torch.equal(tensor, fresh.module.state_dict()[name])
    assert not torch.equal(first.module.token_embedding.weight, untrained.module.token_embedding.weight)


def test_local_hf_model_runs_through_the_same_engines(tmp_path):
    """hf:<path> with a tiny local Llama and a character tokenizer (no download)."""
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from tests.hf_tiny import save_char_llama

    save_char_llama(tmp_path)

    generator = TorchGenerator(load_model(f"hf:{tmp_path}"), max_new_tokens=5)
    trainer = TorchTrainer(load_model(f"hf:{tmp_path}"))
    batch = trained_batch(generator)
    assert torch.equal(response_logprobs(trainer.model, batch), batch["behaviour_logprobs"])
    assert all(isinstance(text, str) for text in generator.decode(batch))
    trainer.begin_train_step(0)
    trainer.train_microbatch(0, batch)
    version = trainer.finish_train_step(0).version
    buckets = list(trainer.weight_buckets(bucket_bytes=8192))
    for index, bucket in enumerate(buckets):
        generator.update_weights(bucket, version, index == len(buckets) - 1)
    for name, tensor in trainer.model.module.state_dict().items():
        assert torch.equal(generator.model.module.state_dict()[name], tensor), name


def test_right_padded_prompts_from_a_data_plane_are_realigned():
    generator = TorchGenerator(small_model(), max_new_tokens=4)
    batch = generator.generate(PROMPTS, 2, seed=3)
    right_ids, right_mask = torch.zeros_like(batch["prompt_ids"]), torch.zeros_like(batch["prompt_mask"])
    for row, (ids, mask) in enumerate(zip(batch["prompt_ids"], batch["prompt_mask"])):
        real = ids[mask.bool()]
        right_ids[row, : len(real)], right_mask[row, : len(real)] = real, 1
    realigned = dict(batch, prompt_ids=right_ids, prompt_mask=right_mask)
    assert torch.equal(TorchLogprob(small_model()).logprobs(realigned), batch["behaviour_logprobs"])


def test_compiler_knows_the_builtin_model_size():
    """check's memory estimate uses a constant; it must match the model."""
    from rldsl.compiler.memory import BUILTIN_PARAMS
    from rldsl.models.tiny import build_tiny_lm

    from rldsl.models.tiny_gpt2 import TINY_GPT2_SHAPE

    for name, shape in (("tiny-lm", {}), ("tiny-gpt2", TINY_GPT2_SHAPE)):
        model = build_tiny_lm(0, **shape)
        assert BUILTIN_PARAMS[name] == sum(p.numel() for p in model.module.parameters())
