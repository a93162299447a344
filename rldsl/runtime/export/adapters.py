"""A LoRA run's checkpoint as a model. The checkpoint holds only the
adapters (``rldsl.models.lora``): the base is loaded as the run loaded it
(the cached warm start of a builtin model, an ``hf:`` directory), the
adapters applied, then merged into the base's own weights for the exported
model; an ``hf:`` base also gets PEFT's adapter directory beside it."""

from __future__ import annotations

import json
from pathlib import Path

from rldsl.models.lora import load_trained_state, merged_state, peft_adapter_config, peft_adapter_state
from rldsl.plan import ModelPlan, PipelinePlan
from rldsl.runtime.export.checkpoints import ExportError

ADAPTER_DIR = "adapter"  # under the exported model: PeftModel.from_pretrained(base, OUT/adapter)


class AdaptedPolicy:
    """The run's base with the checkpoint's adapters on it."""

    def __init__(self, model: ModelPlan, pipe: PipelinePlan, adapters: dict):
        from rldsl.runtime.engines.factory import load_policy

        self.lora = model.lora
        self.policy = load_policy(model, pipe, pipe.run.seed)
        try:
            load_trained_state(self.policy.module, adapters)
        except (ValueError, RuntimeError) as err:
            raise ExportError(f"the checkpoint's adapters do not fit the plan's model: {err}",
                              "export with the plan.json the run wrote") from err

    def write_peft(self, out: Path, base: str) -> None:
        """``adapter_config.json`` and ``adapter_model.safetensors`` (PEFT's names) in ``out``."""
        from safetensors.torch import save_file

        out.mkdir(parents=True)
        config = peft_adapter_config(self.lora.rank, self.lora.alpha, self.lora.targets, base,
                                     _conv1d_targets(self.policy.module))  # GPT-2's Conv1D holds [in, out]
        (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(peft_adapter_state(self.policy.module), str(out / "adapter_model.safetensors"))

    def merged(self) -> dict:
        return merged_state(self.policy.module)


def _conv1d_targets(module) -> bool:
    return any(type(layer).__name__ == "Conv1D" for name, layer in module.named_modules()
               if name.endswith("base_layer"))
