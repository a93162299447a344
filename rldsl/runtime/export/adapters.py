"""A LoRA run's checkpoint as an adapter or a model. The checkpoint holds
only the adapters (``rldsl.models.lora``). On an ``hf:`` base they are
written as PEFT's adapter directory, from the checkpoint alone (the base
is never loaded); for a merged model the base is loaded as the run loaded
it (the cached warm start of a builtin model, an ``hf:`` directory), the
adapters applied, then merged into the base's own weights."""

from __future__ import annotations

import json
from pathlib import Path

from rldsl.models.lora import load_trained_state, merged_state, peft_adapter_config, peft_names
from rldsl.plan import ModelPlan, PipelinePlan
from rldsl.runtime.export.checkpoints import ExportError

ADAPTER_DIR = "adapter"  # under a merged export: PeftModel.from_pretrained(base, OUT/adapter)
CONV1D_MODEL_TYPES = ("gpt2",)  # Hugging Face models whose linear layers are Conv1D ([in, out] weights)


class AdaptedPolicy:
    """The run's adapters, and on demand the base with them merged in."""

    def __init__(self, model: ModelPlan, pipe: PipelinePlan, adapters: dict):
        self.model, self.pipe, self.adapters = model, pipe, adapters
        self.lora = model.lora

    def write_peft(self, out: Path, base: str) -> None:
        """``adapter_config.json`` and ``adapter_model.safetensors`` (PEFT's names) in ``out``, for the
        Hugging Face directory ``base``."""
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        config = peft_adapter_config(self.lora.rank, self.lora.alpha, self.lora.targets, base, _conv1d(base))
        (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(peft_names(self.adapters), str(out / "adapter_model.safetensors"))

    def merged(self) -> dict:
        """The base, loaded as the run loaded it, with the adapters merged into its weights."""
        from rldsl.runtime.engines.factory import load_policy

        policy = load_policy(self.model, self.pipe, self.pipe.run.seed)
        try:
            load_trained_state(policy.module, self.adapters)
        except (ValueError, RuntimeError) as err:
            raise ExportError(f"the checkpoint's adapters do not fit the plan's model: {err}",
                              "export with the plan.json the run wrote") from err
        return merged_state(policy.module)


def _conv1d(base: str) -> bool:
    """GPT-2's Conv1D holds [in, out] weights: PEFT's ``fan_in_fan_out``."""
    try:
        return json.loads((Path(base) / "config.json").read_text()).get("model_type") in CONV1D_MODEL_TYPES
    except (OSError, ValueError) as err:
        raise ExportError(f"the base model's config.json cannot be read: {err}",
                          "the run's `hf:` directory must still exist") from err
