"""Low-rank adapters on a model (`lora_rank` on a `model` block): PEFT's
LoRA layers injected into the module's named linear layers.

Only the adapters train (PEFT freezes every other weight), only they are
pushed to generators and kept in checkpoints: a push is the size of the
adapters, not of the model. Every engine that holds the policy injects the
same adapters from the same seed, so all copies agree before the first push
(PEFT starts ``lora_B`` at zero: the adapted model equals the base); a frozen
reference is the base, the policy with its adapters off (``adapters_off`` on
the trainer's own copy where it is colocated with it). Pipelines sharing a
generator share its base tensors (``share_base``).

Names keep PEFT's ``.lora_A.default.`` form inside the engines (a push
applies tensors by name); ``peft_names`` gives PEFT's saved form
(``.lora_A.weight``), which ``rldsl export`` writes.
"""

from __future__ import annotations

import contextlib

from rldsl.models.base import CausalLM

ADAPTER_PARTS = (".lora_A.", ".lora_B.")
ADAPTER_NAME = "default"  # PEFT's name for a model's one adapter


def is_adapter(name: str) -> bool:
    return any(part in name for part in ADAPTER_PARTS)


def add_lora(model: CausalLM, lora, seed: int = 0) -> CausalLM:
    """Inject adapters (a ``rldsl.plan.LoraPlan``) into ``model`` in place;
    the same seed gives the same initial adapters in every engine."""
    import torch
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=list(lora.targets), lora_dropout=0.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            inject_adapter_in_model(config, model.module)
        except ValueError as error:  # PEFT: no module matched the targets
            raise ValueError(f"`lora_targets = {list(lora.targets)}` names no linear layer of {model.source} "
                             f"({error}); its linear layers: {', '.join(linear_layer_names(model.module)[:12])}"
                             ) from None
    model.lora = lora
    return model


@contextlib.contextmanager
def adapters_off(module):
    """``module`` as its base for the block (its LoRA layers bypassed), in
    evaluation mode; afterwards as before, adapters trainable again. A
    trainer's policy scores a frozen reference this way, without a copy."""
    from peft.tuners.lora import LoraLayer

    layers = [layer for layer in module.modules() if isinstance(layer, LoraLayer)]
    training = module.training
    for layer in layers:
        layer.enable_adapters(False)
    module.eval()
    try:
        yield module
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        module.train(training)


def init_adapter_shard(name: str, tensor) -> None:
    """An adapter tensor (or a shard of one) initialised as PEFT does:
    ``lora_A`` Kaiming-uniform over its inputs, ``lora_B`` zero."""
    import math

    import torch

    if ".lora_B." in name:
        tensor.zero_()
    else:
        torch.nn.init.kaiming_uniform_(tensor, a=math.sqrt(5))


def linear_layer_names(module) -> list[str]:
    """The last part of each linear layer's name, once each, in model order (what `lora_targets` names)."""
    import torch

    names: dict[str, None] = {}
    for name, child in module.named_modules():
        if isinstance(child, torch.nn.Linear) or type(child).__name__ == "Conv1D":
            names[name.rpartition(".")[2]] = None
    return list(names)


def has_adapters(module) -> bool:
    return any(is_adapter(name) for name, _ in module.named_parameters())


def trained_state(module) -> dict:
    """What training changes and a push or checkpoint carries: the adapters
    when the module has them, else the whole state dict."""
    state = module.state_dict()
    if not has_adapters(module):
        return state
    return {name: tensor for name, tensor in state.items() if is_adapter(name)}


def load_trained_state(module, state: dict) -> None:
    """``trained_state``'s output back into ``module``: adapters by name
    (each must exist, none may be missing), or the whole state dict."""
    if not has_adapters(module):
        module.load_state_dict(state)
        return
    own = trained_state(module)
    if set(own) != set(state):
        missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        raise ValueError(f"the checkpoint's adapters do not match the model's (missing {missing[:3]}, "
                         f"unknown {extra[:3]}): it was written with other `lora_rank` / `lora_targets`")
    module.load_state_dict(state, strict=False)


def peft_names(adapters: dict, prefix: str = "base_model.model.") -> dict:
    """Engine-held adapter tensors (``<layer>.lora_A.default.weight``) under
    the names PEFT saves them (``base_model.model.<layer>.lora_A.weight``)."""
    marker = f".{ADAPTER_NAME}."
    return {prefix + name.replace(marker, "."): tensor.detach().cpu().contiguous() for name, tensor in adapters.items()}


def peft_adapter_config(rank: int, alpha: float, targets, base: str, fan_in_fan_out: bool = False) -> dict:
    """``adapter_config.json`` for ``peft.PeftModel.from_pretrained(base_model, directory)`` (vLLM's
    ``LoRARequest`` reads the same directory)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": rank,
            "lora_alpha": alpha, "target_modules": list(targets), "lora_dropout": 0.0, "bias": "none",
            "fan_in_fan_out": fan_in_fan_out, "inference_mode": True}


def merged_state(module) -> dict:
    """The module's weights with the adapters merged in, under the base
    model's own names (what a model without adapters would hold). Merges
    in place: the module is not trained further."""
    from peft.tuners.lora import LoraLayer

    for layer in module.modules():
        if isinstance(layer, LoraLayer):
            layer.merge()
    return {name.replace(".base_layer.", "."): tensor for name, tensor in module.state_dict().items()
            if not is_adapter(name)}


def share_base(module, base) -> int:
    """Make ``module``'s base weights the very tensors ``base`` holds, so a
    generator serving several pipelines keeps one base and an adapter set per
    pipeline (`served_by`). The two must hold equal base weights (checked:
    a shared base that differed would sample from another model). Returns
    the bytes no longer held twice."""
    import torch

    theirs = {_base_name(name): tensor for name, tensor in _base_tensors(base)}
    shared = 0
    for name, owner, attribute, tensor in _base_slots(module):
        other = theirs.get(_base_name(name))
        if other is None or other.shape != tensor.shape or not torch.equal(other, tensor):
            raise ValueError(f"the models do not share one base: `{_base_name(name)}` differs between them, so one "
                             "generator cannot serve both (they must load the same weights)")
        getattr(owner, attribute)[name.rpartition(".")[2]] = other
        shared += tensor.numel() * tensor.element_size()
    return shared


def _base_name(name: str) -> str:
    return name.replace(".base_layer.", ".")


def _base_tensors(module):
    return [(name, tensor) for name, _, _, tensor in _base_slots(module)]


def _base_slots(module):
    """(name, owning module, "_parameters" or "_buffers", tensor) of every weight that is not an adapter's."""
    for prefix, child in module.named_modules():
        for attribute in ("_parameters", "_buffers"):
            for key, tensor in getattr(child, attribute).items():
                name = f"{prefix}.{key}" if prefix else key
                if tensor is not None and not is_adapter(name):
                    yield name, child, attribute, tensor


def state_bytes(state: dict) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in state.values())
