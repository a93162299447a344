"""What serving LoRA adapters on vLLM needs before its engine starts: the
`max_lora_rank` to ask for, and whether vLLM implements LoRA for the
model's architecture at all (vllm.py; pushes: vllm_async.load_adapter)."""

from __future__ import annotations

import json
import os

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's `max_lora_rank` choices


def lora_rank_served(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM takes that serves adapters of ``rank``."""
    fits = [served for served in LORA_RANKS if served >= rank]
    if not fits:
        raise ValueError(f"vLLM serves LoRA ranks up to {LORA_RANKS[-1]}, not {rank}")
    return fits[0]


def lora_unsupported(model_path: str) -> str | None:
    """Why vLLM cannot serve LoRA adapters on this model (it implements them
    for some architectures only: not GPT-2), said before its engine starts,
    whose own error stays in a worker's log; None when it can or when vLLM's
    registry cannot tell (vLLM then decides)."""
    try:
        from vllm.model_executor.models import ModelRegistry
        from vllm.model_executor.models.interfaces import supports_lora

        with open(os.path.join(model_path, "config.json")) as file:
            architecture = json.load(file)["architectures"][0]
        model_class = ModelRegistry._try_load_model_cls(architecture)  # vLLM's registry, by its own name
    except Exception:  # noqa: BLE001 - an unreadable config or another vLLM: let vLLM say
        return None
    if model_class is None or supports_lora(model_class):
        return None
    return (f"vLLM does not serve LoRA adapters for {architecture} (the model at {model_path}); generate with "
            "`engine = torch`, or train every weight (remove `lora_rank`)")
