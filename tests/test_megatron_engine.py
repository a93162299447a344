"""The megatron engines on CPU (megatron-core under the test-only compat shim).

- Hugging Face <-> Megatron conversion (pure torch: runs everywhere);
- a converted model gives the Hugging Face model's logits and the torch
  engine's response logprobs (needs transformers);
- the split step's gradient equals one full-batch backward of the
  normalised loss, every aggregation, on one process and on two
  (data, tensor and pipeline parallel over gloo);
- Megatron's sync hooks are nulled in a step and restored after an
  exception in a microbatch or in finish; abort is idempotent.

Everything runs in fp32 with the fp32 optimizer: bf16, the distributed
optimizer and NCCL need GPUs (see docs/engines.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json

import pytest
import torch

from rldsl.runtime.engines.policy_loss import AGGREGATIONS, PolicyLossConfig, policy_loss
from rldsl.runtime.engines.megatron import hf_weights as hmw
from rldsl.runtime.engines.megatron import rows as megatron_rows
from tests.ports import spawn_ranks

# megatron-core warns about missing Apex / Transformer Engine and its own deprecations on every build.
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

SHAPES = {
    "llama": hmw.LlamaShape(hidden_size=32, ffn_hidden_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                            vocab_size=64, max_positions=64),
    "qwen2": hmw.LlamaShape(hidden_size=32, ffn_hidden_size=48, num_layers=2, num_heads=4, num_kv_heads=1,
                            vocab_size=64, max_positions=64, qkv_bias=True, tied_embeddings=True),
}
ROWS = 10


def random_hf_weights(shape: hmw.LlamaShape, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q_rows, kv_rows = shape.num_heads * shape.kv_channels, shape.num_kv_heads * shape.kv_channels
    sizes = {"model.embed_tokens.weight": (shape.vocab_size, shape.hidden_size),
             "model.norm.weight": (shape.hidden_size,)}
    if not shape.tied_embeddings:
        sizes["lm_head.weight"] = (shape.vocab_size, shape.hidden_size)
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        sizes.update({
            p + "input_layernorm.weight": (shape.hidden_size,),
            p + "post_attention_layernorm.weight": (shape.hidden_size,),
            p + "self_attn.q_proj.weight": (q_rows, shape.hidden_size),
            p + "self_attn.k_proj.weight": (kv_rows, shape.hidden_size),
            p + "self_attn.v_proj.weight": (kv_rows, shape.hidden_size),
            p + "self_attn.o_proj.weight": (shape.hidden_size, q_rows),
            p + "mlp.gate_proj.weight": (shape.ffn_hidden_size, shape.hidden_size),
            p + "mlp.up_proj.weight": (shape.ffn_hidden_size, shape.hidden_size),
            p + "mlp.down_proj.weight": (shape.hidden_size, shape.ffn_hidden_size),
        })
        if shape.qkv_bias:
            biases = zip("qkv", (q_rows, kv_rows, kv_rows))
            sizes.update({p + f"self_attn.{x}_proj.bias": (rows,) for x, rows in biases})
    return {name: 0.2 * torch.randn(size, generator=gen) for name, size in sizes.items()}


# -- conversion: pure torch ------------------------------------------------------------


@pytest.mark.parametrize("fused_norms", [False, True], ids=["local", "te"])
@pytest.mark.parametrize("kind", SHAPES)
def test_hf_megatron_round_trip_is_exact(kind, fused_norms):
    shape = SHAPES[kind]
    hf = random_hf_weights(shape)
    back = hmw.megatron_to_hf(hmw.hf_to_megatron(hf, shape, fused_norms), shape, fused_norms)
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[name], hf[name]) for name in hf)


def test_fused_qkv_is_interleaved_per_query_group():
    shape = SHAPES["llama"]  # 4 query heads in 2 groups, head_dim 8
    d, hidden = shape.kv_channels, shape.hidden_size
    def rows(first: int, count: int) -> torch.Tensor:  # row r holds the value first + r
        return (first + torch.arange(count))[:, None].float().expand(-1, hidden)

    q, k, v = rows(0, 4 * d), rows(100, 2 * d), rows(200, 2 * d)
    fused = hmw.fuse_qkv(q, k, v, shape)[:, 0]
    group0 = torch.cat([torch.arange(2 * d), 100 + torch.arange(d), 200 + torch.arange(d)]).float()
    assert torch.equal(fused[: 4 * d], group0)
    assert torch.equal(fused[4 * d : 5 * d], torch.arange(2 * d, 3 * d).float())  # group 1 starts with q head 2


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_split_and_merge_round_trip(tp):
    shape = hmw.LlamaShape(hidden_size=32, ffn_hidden_size=48, num_layers=1, num_heads=8, num_kv_heads=4,
                           vocab_size=64, qkv_bias=True)
    for name, tensor in hmw.hf_to_megatron(random_hf_weights(shape), shape).items():
        shards = hmw.split_for_tensor_parallel(name, tensor, tp)
        assert torch.equal(hmw.merge_tensor_parallel(name, shards), tensor), name


def test_gated_fc1_shards_hold_matching_gate_and_up_rows():
    gate, up = torch.arange(8.0)[:, None], 100 + torch.arange(8.0)[:, None]
    shards = hmw.split_for_tensor_parallel("decoder.layers.0.mlp.linear_fc1.weight", torch.cat([gate, up]), 2)
    assert torch.equal(shards[1][:, 0], torch.tensor([4.0, 5, 6, 7, 104, 105, 106, 107]))


def test_assembler_waits_for_every_part_of_a_fused_weight():
    shape = SHAPES["llama"]
    hf = random_hf_weights(shape)
    expected = hmw.hf_to_megatron(hf, shape)
    assembler = hmw.HFToMegatronAssembler(shape)
    names = sorted(hf)
    first = dict(assembler.add((n, hf[n]) for n in names if not n.endswith("v_proj.weight")))
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in assembler.pending()
    second = dict(assembler.add((n, hf[n]) for n in names if n.endswith("v_proj.weight")))
    assert not assembler.pending()
    assembled = {**first, **second}
    assert assembled.keys() == expected.keys()
    assert all(torch.equal(assembled[n], expected[n]) for n in expected)


LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


def test_shape_from_hf_config_reads_qwen2_biases_and_new_rope_format():
    config = {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
              "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
              "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}
    shape = hmw.LlamaShape.from_hf_config(config)
    assert shape.qkv_bias and shape.tied_embeddings and shape.rope_theta == 1e6 and shape.kv_channels == 64
    with pytest.raises(NotImplementedError):
        hmw.LlamaShape.from_hf_config({**config, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    llama3 = {**config, "rope_scaling": LLAMA31_ROPE}  # Llama 3.1 / 3.3 (3.2: factor 32)
    assert hmw.LlamaShape.from_hf_config(llama3).rope_scaling_factor == 8.0
    assert hmw.LlamaShape.from_hf_config(config).rope_scaling_factor is None
    with pytest.raises(NotImplementedError, match="original_max_position_embeddings"):  # megatron fixes it at 8192
        hmw.LlamaShape.from_hf_config({**config, "rope_scaling": {**LLAMA31_ROPE,
                                                                  "original_max_position_embeddings": 4096}})
    qwen3_moe = {**config, "model_type": "qwen3_moe", "num_experts": 128, "moe_intermediate_size": 768,
                 "num_experts_per_tok": 8, "router_aux_loss_coef": 0.001}
    moe = hmw.LlamaShape.from_hf_config(qwen3_moe)
    assert (moe.num_experts, moe.expert_ffn_hidden_size, moe.router_topk, moe.qk_norm) == (128, 768, 8, True)
    assert moe.norm_topk_prob and moe.router_aux_loss == 0.0  # Hugging Face adds it only with the router's logits
    assert hmw.LlamaShape.from_hf_config({**qwen3_moe, "output_router_logits": True}).router_aux_loss == 0.001
    mixtral = {**config, "model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2}
    with pytest.raises(NotImplementedError, match="model type 'mixtral' is not converted"):
        hmw.LlamaShape.from_hf_config(mixtral)  # never read as its dense width
    with pytest.raises(NotImplementedError, match="model type 'gemma2' is not converted"):
        hmw.LlamaShape.from_hf_config({**config, "model_type": "gemma2"})  # its extra norms would be dropped
    with pytest.raises(NotImplementedError, match="dense layers between"):
        hmw.LlamaShape.from_hf_config({**qwen3_moe, "mlp_only_layers": [0]})


# -- megatron-core on CPU -------------------------------------------------------------


def make_trainer(shape, weights, **overrides):
    from rldsl.runtime.engines.megatron.trainer import MegatronTrainer

    options = dict(dtype="fp32", distributed_optimizer=False, overlap_grad_reduce=True, lr=0.0, max_grad_norm=None)
    return MegatronTrainer(shape, weights, **{**options, **overrides})


def make_batch(shape: hmw.LlamaShape) -> dict:
    """Uneven left padding and response lengths; ratios != 1."""
    gen = torch.Generator().manual_seed(7)
    prompt_len, response_len = 6, 5
    prompt_ids = torch.randint(1, shape.vocab_size, (ROWS, prompt_len), generator=gen)
    prompt_mask = torch.ones_like(prompt_ids)
    response_ids = torch.randint(1, shape.vocab_size, (ROWS, response_len), generator=gen)
    response_mask = torch.zeros_like(response_ids)
    for row in range(ROWS):
        pad = row % 4
        prompt_ids[row, :pad], prompt_mask[row, :pad] = 0, 0
        response_mask[row, : 1 + (row * 3) % response_len] = 1
    batch = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "response_ids": response_ids * response_mask,
             "response_mask": response_mask}
    noise = lambda: 0.3 * torch.randn(ROWS, response_len, generator=gen)  # noqa: E731
    batch["behaviour_logprobs"] = (-2.0 + noise()) * response_mask
    batch["ref_logprobs"] = (-2.0 + noise()) * response_mask
    batch["advantage"] = torch.randn(ROWS, generator=gen)
    return batch


def reference_logprobs(megatron, shape, weights, batch) -> torch.Tensor:
    """The batch's response logprobs under ``weights``, one forward, no DDP."""
    model = megatron.build_gpt_model(shape, megatron.transformer_config(shape, "fp32"))
    megatron.load_hf_weights(model, weights, shape)
    packed = megatron_rows.pack_rows(batch, "cpu")
    with torch.no_grad():
        return megatron_rows.response_logprobs_from_logits(megatron_rows.forward_logits(model, packed), packed)


def engine_mismatch(trainer_logprobs, batch, same_version: torch.Tensor) -> dict[str, float]:
    """``mismatch/...`` as the torch trainer reports it, computed over the whole batch at once."""
    on = (batch["response_mask"] > 0) & same_version[:, None]
    delta = (trainer_logprobs - batch["behaviour_logprobs"]).double()[on]
    return {"mismatch/tokens": float(on.sum()), "mismatch/abs_diff_mean": float(delta.abs().mean()),
            "mismatch/abs_diff_max": float(delta.abs().max()),
            "mismatch/kl": float((torch.exp(delta) - 1 - delta).mean())}


def reference_gradients(megatron, shape, weights, batch, config, device="cpu") -> dict[str, torch.Tensor]:
    """One forward/backward over the whole batch of the normalised loss, no DDP."""
    model = megatron.build_gpt_model(shape, megatron.transformer_config(shape, "fp32")).to(device)
    megatron.load_hf_weights(model, weights, shape)
    batch = {name: value.to(device) for name, value in batch.items()}
    packed = megatron_rows.pack_rows(batch, device)
    logprobs = megatron_rows.response_logprobs_from_logits(megatron_rows.forward_logits(model, packed), packed)
    proximal = logprobs.detach() if config.needs_proximal else None  # the batch-start weights are these
    out = policy_loss(logprobs, batch["behaviour_logprobs"], batch["advantage"], batch["response_mask"], config,
                      batch["ref_logprobs"], proximal)
    (out.loss_sum / out.count).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.megatron
@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_split_step_gradient_equals_full_batch_gradient(megatron, agg):
    shape = SHAPES["llama"]
    weights = random_hf_weights(shape, seed=1)
    batch = make_batch(shape)
    config = PolicyLossConfig(clip=0.2, kl=0.05, agg=agg)
    expected = reference_gradients(megatron, shape, weights, batch, config)
    trainer = make_trainer(shape, weights, loss=config, rows_per_forward=2)  # lr 0: the weights stay put
    # Two steps: leaving no_sync_func in place breaks the SECOND step (seed 001).
    for step in range(2):
        trainer.begin_train_step(step)
        for start, stop in [(0, 3), (3, 4), (4, 10)]:  # uneven microbatches, several pipeline microbatches each
            trainer.train_microbatch(step, {name: value[start:stop] for name, value in batch.items()})
        result = trainer.finish_train_step(step)
    assert result.version == 2 and result.metrics["tokens"] == float(batch["response_mask"].sum())
    actual = {name: p.main_grad for name, p in trainer.model.module.named_parameters()}
    assert actual.keys() == expected.keys()
    scale = max(float(g.abs().max()) for g in expected.values())
    worst = max(float((actual[n] - expected[n]).abs().max()) for n in expected) / scale
    assert worst < 1e-5


@pytest.mark.megatron
@pytest.mark.parametrize("budget", [1, 20])  # 1: a row per forward; 20: rows packed up to 20 real tokens
def test_split_step_with_a_token_budget_equals_full_batch_gradient(megatron, budget):
    shape = SHAPES["llama"]
    weights = random_hf_weights(shape, seed=1)
    batch = make_batch(shape)
    config = PolicyLossConfig(clip=0.2, kl=0.05, agg="seq_mean_token_mean")
    expected = reference_gradients(megatron, shape, weights, batch, config)
    trainer = make_trainer(shape, weights, loss=config, tokens_per_forward=budget)
    trainer.begin_train_step(0)
    for start, stop in [(0, 6), (6, 10)]:
        trainer.train_microbatch(0, {name: value[start:stop] for name, value in batch.items()})
    trainer.finish_train_step(0)
    actual = {name: p.main_grad for name, p in trainer.model.module.named_parameters()}
    scale = max(float(g.abs().max()) for g in expected.values())
    assert max(float((actual[n] - expected[n]).abs().max()) for n in expected) / scale < 1e-5


@pytest.mark.megatron
def test_mini_batches_take_an_optimizer_and_scheduler_step_each_and_one_version(megatron):
    from rldsl.runtime.engines.schedule import LRSchedule

    shape = SHAPES["qwen2"]
    weights, batch = random_hf_weights(shape, seed=1), make_batch(shape)
    mini_batches = [(0, 3), (3, 7), (7, 10)]
    schedule = LRSchedule("linear", warmup=1, total=4)
    options = dict(lr=1e-2, max_grad_norm=1.0, lr_schedule=schedule)
    mini, separate = make_trainer(shape, weights, **options), make_trainer(shape, weights, **options)
    mini.begin_train_step(0)
    taken = []
    for index, (start, stop) in enumerate(mini_batches):
        mini.train_microbatch(0, {name: value[start:stop] for name, value in batch.items()})
        if index < len(mini_batches) - 1:
            taken.append(mini.optimizer_step(0))
            assert mini.version == 0
    result = mini.finish_train_step(0)
    expected = []
    for step, (start, stop) in enumerate(mini_batches):
        separate.begin_train_step(step)
        separate.train_microbatch(step, {name: value[start:stop] for name, value in batch.items()})
        expected.append(separate.finish_train_step(step).metrics)
    assert result.version == 1 and separate.version == 3
    assert mini.scheduler.num_steps == 3 and result.metrics["optimizer_steps"] == 3.0
    assert [m["lr"] for m in taken] + [result.metrics["lr"]] == [schedule.lr_at(k, 1e-2) for k in range(3)]
    assert [m["loss"] for m in taken] == [m["loss"] for m in expected[:2]]
    assert result.metrics["loss"] == pytest.approx(sum(m["loss"] for m in expected) / 3)
    for (name, mine), theirs in zip(mini.model.module.named_parameters(), separate.model.module.parameters()):
        assert torch.equal(mine, theirs), name


def hooks(trainer) -> dict:
    names = ("grad_sync_func", "no_sync_func", "finalize_model_grads_func")
    return {name: getattr(trainer.config, name) for name in names}


@pytest.mark.megatron
def test_sync_hooks_are_nulled_in_a_step_and_restored_after_a_failing_microbatch(megatron):
    shape = SHAPES["llama"]
    trainer = make_trainer(shape, random_hf_weights(shape), lr=1e-2)
    original = hooks(trainer)
    assert all(hook is not None for hook in original.values())
    trainer.begin_train_step(0)
    assert hooks(trainer) == {"grad_sync_func": None, "no_sync_func": contextlib.nullcontext,
                              "finalize_model_grads_func": None}
    broken = {k: v for k, v in make_batch(shape).items() if k != "advantage"}
    with pytest.raises(KeyError):
        trainer.train_microbatch(0, broken)
    assert hooks(trainer) == original
    with pytest.raises(RuntimeError, match="abort"):
        trainer.train_microbatch(0, make_batch(shape))
    trainer.abort_train_step(0)
    trainer.abort_train_step(0)
    assert hooks(trainer) == original
    assert trainer.version == 0
    run_clean_step(trainer, shape, step=1)
    assert trainer.version == 1 and hooks(trainer) == original


@pytest.mark.megatron
def test_sync_hooks_are_restored_after_a_failing_finish(megatron, monkeypatch):
    shape = SHAPES["qwen2"]
    trainer = make_trainer(shape, random_hf_weights(shape), lr=1e-2)
    original = hooks(trainer)
    trainer.begin_train_step(0)
    trainer.train_microbatch(0, make_batch(shape))

    def failing_step():
        raise RuntimeError("optimizer failed")

    monkeypatch.setattr(trainer.optimizer, "step", failing_step)
    with pytest.raises(RuntimeError, match="optimizer failed"):
        trainer.finish_train_step(0)
    assert hooks(trainer) == original
    monkeypatch.undo()
    trainer.abort_train_step(0)
    trainer.abort_train_step(0)
    assert trainer.version == 0 and hooks(trainer) == original
    assert all(float(p.main_grad.abs().max()) == 0 for p in trainer.model.module.parameters())
    run_clean_step(trainer, shape, step=1)
    assert trainer.version == 1


def run_clean_step(trainer, shape, step: int):
    trainer.begin_train_step(step)
    trainer.train_microbatch(step, make_batch(shape))
    return trainer.finish_train_step(step)


@pytest.mark.megatron
def test_abort_without_open_step_and_empty_step_are_harmless(megatron):
    shape = SHAPES["llama"]
    trainer = make_trainer(shape, random_hf_weights(shape), overlap_grad_reduce=False, lr=1e-2)
    original = hooks(trainer)
    trainer.abort_train_step(3)
    trainer.abort_train_step(3)
    empty = make_batch(shape)
    empty["response_mask"] = torch.zeros_like(empty["response_mask"])
    trainer.begin_train_step(0)
    trainer.train_microbatch(0, empty)
    result = trainer.finish_train_step(0)
    assert result.version == 0 and result.metrics == {"skipped": 1.0}
    assert hooks(trainer) == original
    with pytest.raises(RuntimeError, match="without an open step"):
        trainer.finish_train_step(0)


@pytest.mark.megatron
@pytest.mark.parametrize("kind", SHAPES)
def test_weight_buckets_give_back_the_hf_weights_and_change_after_a_step(megatron, kind):
    shape = SHAPES[kind]
    weights = random_hf_weights(shape)
    trainer = make_trainer(shape, weights, lr=1e-2, max_grad_norm=1.0)
    largest = max(t.numel() * t.element_size() for t in weights.values())
    buckets = list(trainer.weight_buckets(largest // 2))
    exported = {name: tensor for bucket in buckets for name, tensor in bucket.items()}
    assert exported.keys() == weights.keys()
    assert all(torch.equal(exported[name], weights[name]) for name in weights)
    assert all(len(b) == 1 for b in buckets if sum(t.numel() * t.element_size() for t in b.values()) > largest // 2)
    on_device = [b for b in trainer.weight_buckets(largest // 2, on_host=False)]  # a push's: as gathered
    assert [list(b) for b in on_device] == [list(b) for b in buckets]
    assert all(torch.equal(b[name].cpu(), a[name]) for a, b in zip(buckets, on_device) for name in a)
    result = run_clean_step(trainer, shape, step=0)
    assert result.version == 1 and result.metrics["grad_norm"] > 0
    after = {n: t for b in trainer.weight_buckets(1 << 20) for n, t in b.items()}
    query = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(after[query], weights[query])


@pytest.mark.megatron
def test_moe_aux_loss_metrics_are_divided_by_the_pipeline_microbatches_of_the_step(megatron):
    from megatron.core.transformer.moe import moe_utils

    shape = SHAPES["llama"]
    trainer = make_trainer(shape, random_hf_weights(shape), rows_per_forward=4, lr=1e-3)
    trainer.config.num_moe_experts = 2  # as if the layers were MoE: only the metrics read it here
    trainer.begin_train_step(0)
    trainer.train_microbatch(0, make_batch(shape))  # 10 rows in pipeline microbatches of 4: 3 of them
    for layer, per_microbatch in ((1, 0.25), (2, 0.5)):  # what the routers would have logged
        for _ in range(3):
            moe_utils.save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(per_microbatch), layer, 2)
    metrics = trainer.finish_train_step(0).metrics
    assert metrics["moe/load_balancing_loss"] == pytest.approx((0.25 + 0.5) / 2)
    assert float(moe_utils.get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"].sum()) == 0


# -- against Hugging Face transformers ---------------------------------------------------


HF_CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    # Llama 3.1's rope: with theta 5e5 two of the four frequencies of a head of 8 are scaled or smoothed
    "llama3.1": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False, rope_theta=500000.0,
                                                         rope_scaling=LLAMA31_ROPE)),
}


@pytest.fixture(params=list(HF_CONFIGS))
def hf_checkpoint(request, tmp_path):
    """A tiny random Hugging Face model saved to a local directory."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    config_name, model_name, extra = HF_CONFIGS[request.param]
    config = getattr(transformers, config_name)(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    model.save_pretrained(tmp_path)
    return tmp_path, model


@pytest.mark.megatron
def test_converted_model_gives_the_hf_logits(megatron, hf_checkpoint):
    path, hf_model = hf_checkpoint
    shape = hmw.LlamaShape.from_hf_config(json.loads((path / "config.json").read_text()))
    model = megatron.build_gpt_model(shape, megatron.transformer_config(shape, "fp32"))
    megatron.load_hf_weights(model, megatron.read_hf_weights(path), shape)
    tokens = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(1))
    packed = megatron_rows.PackedRows(tokens, torch.arange(12).expand(3, 12), None, None, {})
    with torch.no_grad():
        expected = hf_model(input_ids=tokens).logits
        actual = megatron_rows.forward_logits(model.eval(), packed)
    assert actual.shape == expected.shape
    assert float((actual - expected).abs().max()) < 1e-5


QWEN3 = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64, rms_norm_eps=1e-6,
             tie_word_embeddings=False)
QWEN3_MOE = dict(QWEN3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)


@pytest.mark.megatron
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe", "qwen3_moe_unnormalised"])
def test_qwen3_and_its_mixture_of_experts_convert_both_ways(megatron, kind, tmp_path):
    """Qwen3's per-head query and key norms, and Qwen3-MoE's router and
    experts (renormalised top-k or not): the Hugging Face logits after load,
    the Hugging Face tensors exactly after export."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    if kind == "qwen3":
        hf_model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN3))
    else:
        config = transformers.Qwen3MoeConfig(**QWEN3_MOE, norm_topk_prob=kind == "qwen3_moe")
        torch.manual_seed(0)
        hf_model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():  # norms away from 1, so that a dropped one shows
        for name, parameter in hf_model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                parameter.uniform_(0.5, 2.0)
    hf_model.eval().save_pretrained(tmp_path)
    shape = hmw.LlamaShape.from_hf_config(json.loads((tmp_path / "config.json").read_text()))
    assert shape.qk_norm and shape.num_experts == (0 if kind == "qwen3" else 4)
    model = megatron.build_gpt_model(shape, megatron.transformer_config(shape, "fp32"))
    saved = megatron.read_hf_weights(tmp_path)
    megatron.load_hf_weights(model, saved, shape)
    tokens = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(1))
    packed = megatron_rows.PackedRows(tokens, torch.arange(12).expand(3, 12), None, None, {})
    with torch.no_grad():
        expected = hf_model(input_ids=tokens).logits
        actual = megatron_rows.forward_logits(model.eval(), packed)
    assert float((actual - expected).abs().max()) < 1e-5
    exported = dict(megatron.export_hf_weights(model, shape))
    assert exported.keys() == saved.keys()
    assert all(torch.equal(exported[name], saved[name]) for name in saved)


@pytest.mark.megatron
def test_a_weight_the_conversion_does_not_know_stops_the_load(megatron):
    """What dropped Qwen3's query and key norms before they were converted: a
    tensor no Megatron weight is made of is an error, not silently left out."""
    shape = SHAPES["llama"]
    weights = random_hf_weights(shape)
    model = megatron.build_gpt_model(shape, megatron.transformer_config(shape, "fp32"))
    with pytest.raises(ValueError, match=r"1 Hugging Face weights have no place.*pre_feedforward_layernorm"):
        megatron.load_hf_weights(model, {**weights, "model.layers.0.pre_feedforward_layernorm.weight":
                                         torch.ones(shape.hidden_size)}, shape)
    megatron.load_hf_weights(model, {**weights, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)},
                             shape)  # a buffer some checkpoints save: derived, not a weight


@pytest.mark.megatron
@pytest.mark.parametrize("hf_checkpoint", ["llama3.1"], indirect=True)
def test_llama31_rope_scaling_is_converted_and_matters_at_long_positions(megatron, hf_checkpoint, tmp_path):
    _, hf_model = hf_checkpoint
    with torch.no_grad():  # sharp attention (a random init's is near uniform and hides the positions)
        for name, parameter in hf_model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                parameter.mul_(40.0)
    path = tmp_path / "sharp"
    hf_model.save_pretrained(path)
    shape = hmw.LlamaShape.from_hf_config(json.loads((path / "config.json").read_text()))
    tokens = torch.randint(0, 64, (2, 60), generator=torch.Generator().manual_seed(1))
    packed = megatron_rows.PackedRows(tokens, torch.arange(60).expand(2, 60), None, None, {})
    logits = {}
    for name, built in (("scaled", shape), ("plain", dataclasses.replace(shape, rope_scaling_factor=None))):
        model = megatron.build_gpt_model(built, megatron.transformer_config(built, "fp32"))
        megatron.load_hf_weights(model, megatron.read_hf_weights(path), built)
        with torch.no_grad():
            logits[name] = megatron_rows.forward_logits(model.eval(), packed)
    with torch.no_grad():
        expected = hf_model(input_ids=tokens).logits
    assert float((logits["scaled"] - expected).abs().max()) < 1e-5
    assert float((logits["plain"] - expected).abs().max()) > 1e-3  # unscaled rope would be visibly wrong


@pytest.mark.megatron
@pytest.mark.parametrize("budget", [0, 20])  # by rows, or by a token budget with padding trimmed
def test_megatron_logprobs_match_the_torch_engine_on_padded_rows(megatron, hf_checkpoint, budget):
    from rldsl.models.hf import HFCausalLM
    from rldsl.runtime.engines.megatron.logprob import MegatronLogprob
    from rldsl.runtime.engines.torch.common import response_logprobs

    path, hf_model = hf_checkpoint
    engine = MegatronLogprob.from_pretrained(str(path), dtype="fp32", rows_per_forward=4, tokens_per_forward=budget)
    batch = make_batch(engine.shape)
    with torch.no_grad():
        expected = response_logprobs(HFCausalLM(hf_model, None, "hf:test", {}), batch)
    actual = engine.logprobs(batch)
    assert float((actual - expected).abs().max()) < 1e-5


@pytest.mark.megatron
def test_megatron_logprob_takes_hf_buckets_that_split_fused_weights(megatron):
    from rldsl.runtime.engines.megatron.logprob import MegatronLogprob

    shape = SHAPES["qwen2"]
    old, new = random_hf_weights(shape, seed=1), random_hf_weights(shape, seed=2)
    engine = MegatronLogprob(shape, old, dtype="fp32")
    expected = MegatronLogprob(shape, new, dtype="fp32").logprobs(make_batch(shape))
    second = [n for n in new if n.endswith("v_proj.weight")]  # q and k arrive one bucket before v
    first = [n for n in new if n not in second]
    engine.update_weights({n: new[n] for n in first}, version=3, last=False)
    assert engine.version == 0
    with pytest.raises(RuntimeError, match="in progress"):
        engine.logprobs(make_batch(shape))
    engine.update_weights({n: new[n] for n in second}, version=3, last=True)
    assert engine.version == 3
    assert torch.equal(engine.logprobs(make_batch(shape)), expected)


# -- two processes over gloo: data, tensor and pipeline parallelism ---------------------------

# (tp, pp, overlap_grad_reduce) on 2 ranks; tp = pp = 1 is dp = 2. Without overlap,
# finish_grad_sync runs the reduction itself (a start_grad_sync too would double it).
PARALLEL_LAYOUTS = [(1, 1, True), (1, 1, False), (2, 1, True), (1, 2, True)]
# Tied embeddings (synced across pipeline stages by finalize_model_grads) and q/k/v biases.
PARALLEL_SHAPE = hmw.LlamaShape(hidden_size=32, ffn_hidden_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                                vocab_size=64, max_positions=64, qkv_bias=True, tied_embeddings=True)
DP2_MICROBATCHES = {0: [(0, 3), (3, 7)], 1: [(7, 10)]}  # uneven: rank 1 holds fewer rows


def _parallel_worker(rank: int, port: int, results: dict):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from megatron.core import parallel_state

    from rldsl.runtime.engines.megatron import model as megatron_model
    from rldsl.runtime.engines.megatron.cpu_compat import megatron_on_cpu

    shape = PARALLEL_SHAPE
    weights, batch = random_hf_weights(shape, seed=1), make_batch(shape)
    try:
        with megatron_on_cpu():
            for tp, pp, overlap in PARALLEL_LAYOUTS:
                megatron_model.ensure_model_parallel(tp, pp, seed=0)
                trainer = make_trainer(shape, weights, loss=PolicyLossConfig(kl=0.05), rows_per_forward=2, tp=tp, pp=pp,
                                       overlap_grad_reduce=overlap)
                dp_size = parallel_state.get_data_parallel_world_size()
                rows = DP2_MICROBATCHES[parallel_state.get_data_parallel_rank()] if dp_size == 2 else [(0, 4), (4, 10)]
                # step 1's rows generated at version 1 are on the trainer's own weights (lr 0: version 0's)
                batch["version"] = torch.arange(ROWS) % 2
                for step in range(2):
                    trainer.begin_train_step(step)
                    for start, stop in rows:
                        trainer.train_microbatch(step, {k: v[start:stop] for k, v in batch.items()})
                    metrics = trainer.finish_train_step(step).metrics
                offset = megatron_model.layer_offset(trainer.model.module)
                grads = {hmw.with_layer_offset(n, offset): p.main_grad.clone()
                         for n, p in trainer.model.module.named_parameters()}
                exported, gathers = streamed_export(trainer)
                tp_rank = parallel_state.get_tensor_model_parallel_rank()
                results[(tp, pp, overlap, rank)] = (tp_rank, grads, exported, metrics)
                results[("gathers", tp, pp, overlap, rank)] = gathers
                results[("beside a step", tp, pp, overlap, rank)] = export_beside_a_step(trainer, batch, rows)
                parallel_state.destroy_model_parallel()
    finally:
        dist.destroy_process_group()


def export_beside_a_step(trainer, batch, rows) -> dict:
    """The weights exported on another thread while this one trains a step's
    microbatches (on Ray: the push's concurrency group beside the step's
    calls). The export gathers on groups of its own, so the two threads'
    collectives never pair up across ranks: it neither hangs nor mixes. As a
    push takes them: on the device, not copied to host memory."""
    import threading

    out = {}

    def export() -> None:
        out["weights"] = {n: t.clone() for b in trainer.weight_buckets(4096, on_host=False) for n, t in b.items()}

    trainer.begin_train_step(2)
    thread = threading.Thread(target=export)
    thread.start()
    for start, stop in rows:
        trainer.train_microbatch(2, {k: v[start:stop] for k, v in batch.items()})
    thread.join(timeout=120)
    assert not thread.is_alive(), "the export beside the step hung"
    trainer.abort_train_step(2)
    return out["weights"]


def streamed_export(trainer) -> tuple[dict, tuple[int, int]]:
    """The trainer's exported weights, and how many tensor-parallel gathers
    ran before its first bucket came and in all: a streamed export gathers a
    tensor only when the buckets before it are out."""
    import torch.distributed as dist

    calls, all_gather = [], dist.all_gather
    dist.all_gather = lambda *args, **kwargs: calls.append(1) or all_gather(*args, **kwargs)
    try:
        buckets = trainer.weight_buckets(4096)
        first = next(buckets, {})
        before_first = len(calls)
        exported = {n: t for b in (first, *buckets) for n, t in b.items()}
    finally:
        dist.all_gather = all_gather
    return exported, (before_first, len(calls))


@pytest.mark.megatron
def test_data_tensor_and_pipeline_parallel_gradients_and_export_on_two_ranks(megatron):
    shape = PARALLEL_SHAPE
    weights, batch = random_hf_weights(shape, seed=1), make_batch(shape)
    expected = reference_gradients(megatron, shape, weights, batch, PolicyLossConfig(kl=0.05))
    logprobs = reference_logprobs(megatron, shape, weights, batch)
    mismatch = engine_mismatch(logprobs, batch, torch.arange(ROWS) % 2 == 1)
    # the ratio pi_trainer / pi_generator of the last step over every token: its extremes
    ratio = torch.exp(logprobs - batch["behaviour_logprobs"])[batch["response_mask"] > 0]
    ratio_extremes = float(ratio.max()), float(ratio.min())
    results = spawn_ranks(_parallel_worker)
    scale = max(float(g.abs().max()) for g in expected.values())
    for layout in PARALLEL_LAYOUTS:
        shards: dict[str, dict[int, torch.Tensor]] = {}
        for rank in range(2):
            tp_rank, grads, _, _ = results[(*layout, rank)]
            for name, grad in grads.items():
                shards.setdefault(name, {})[tp_rank] = grad
        merged = {n: hmw.merge_tensor_parallel(n, [s[r] for r in sorted(s)]) for n, s in shards.items()}
        worst = max(float((merged[n] - expected[n]).abs().max()) for n in expected) / scale
        assert worst < 1e-5, (layout, worst)
        _, _, exported, metrics = results[(*layout, 0)]
        assert exported.keys() == weights.keys() and all(torch.equal(exported[n], weights[n]) for n in weights)
        beside = results[("beside a step", *layout, 0)]
        assert beside.keys() == weights.keys() and all(torch.equal(beside[n], weights[n]) for n in weights)
        before_first, gathers = results[("gathers", *layout, 0)]
        if layout[0] == 2:  # tensor-parallel: one tensor gathered at a time, never the whole stage first
            assert 0 < before_first < gathers, (layout, before_first, gathers)
        assert metrics == results[(*layout, 1)][3]  # every rank reports the same global metrics
        assert metrics["tokens"] == float(batch["response_mask"].sum())
        # the generator's logprobs against the trainer's: sums over dp ranks, extremes by max over dp and pp
        for name, value in mismatch.items():
            assert metrics[name] == pytest.approx(value, rel=1e-5), (layout, name)
        assert metrics["mismatch_ratio_max"] == pytest.approx(ratio_extremes[0], rel=1e-5), layout
        assert metrics["mismatch_ratio_min"] == pytest.approx(ratio_extremes[1], rel=1e-5), layout
