"""A mixture of experts' weights travel under checkpoint names: transformers 5
fuses each layer's experts into two parameters, checkpoints, vLLM and the
megatron engine name every expert (rldsl.models.hf_layout)."""

import pytest
import torch

from rldsl.models.hf_layout import checkpoint_named, runtime_view

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    from tests.hf_tiny import save_char_llama

    return save_char_llama(tmp_path_factory.mktemp("qwen3_moe"), architecture="Qwen3Moe", hidden_size=64,
                           intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                           num_attention_heads=2, num_key_value_heads=2, head_dim=32)


def _on_disk(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_a_push_carries_the_checkpoints_tensors_and_names(qwen3_moe):
    """The torch engines' pushes (the state dict through ``checkpoint_named``)
    are the checkpoint's tensors bit for bit, each expert under its own name."""
    from rldsl.models import load_model
    from rldsl.runtime.engines.torch.common import state_buckets

    model = load_model(f"hf:{qwen3_moe}")
    assert any(name.endswith("experts.gate_up_proj") for name in model.module.state_dict())  # fused in memory
    pushed = {name: tensor for bucket in state_buckets(model.module, 1 << 20) for name, tensor in bucket.items()}
    disk = _on_disk(qwen3_moe)
    assert pushed.keys() == disk.keys()
    assert all(torch.equal(pushed[name], disk[name]) for name in disk)


def test_a_generator_takes_a_push_of_checkpoint_named_experts(qwen3_moe):
    """A received expert's tensor fills its slice of the fused parameter: the
    generator's logits become the checkpoint's."""
    from rldsl.models import load_model
    from rldsl.runtime.engines.torch.generate import TorchGenerator

    trained, fresh = load_model(f"hf:{qwen3_moe}"), load_model(f"hf:{qwen3_moe}")
    with torch.no_grad():
        for parameter in fresh.module.parameters():
            parameter.normal_()
    generator = TorchGenerator(fresh, max_new_tokens=2)
    disk = list(_on_disk(qwen3_moe).items())
    generator.update_weights(dict(disk[:7]), 1, last=False)  # the version's buckets split an expert's tensors
    generator.update_weights(dict(disk[7:]), 1, last=True)
    tokens = torch.randint(4, 40, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(fresh.module(input_ids=tokens).logits, trained.module(input_ids=tokens).logits)
    assert generator.version == 1


def test_a_dense_model_and_unknown_names_pass_through():
    weights = {"model.layers.0.mlp.gate_proj.weight": torch.ones(2, 2)}
    assert dict(checkpoint_named(weights.items())) == weights
    assert runtime_view("model.layers.0.mlp.experts.9.gate_proj.weight",
                        {"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(4, 6, 3)}) is None  # no expert 9


def test_an_export_of_checkpoint_named_experts_writes_the_model(qwen3_moe, tmp_path):
    """What the megatron engine's checkpoints hold: each expert under its own
    name; the export stacks them as transformers fuses them and writes a
    model directory transformers loads with the same weights."""
    import transformers

    from rldsl.runtime.export.writer import save_model

    disk = _on_disk(qwen3_moe)
    save_model(tmp_path, transformers.AutoConfig.from_pretrained(qwen3_moe), dict(disk))
    assert _on_disk(tmp_path).keys() == disk.keys()
    assert all(torch.equal(_on_disk(tmp_path)[name], disk[name]) for name in disk)
