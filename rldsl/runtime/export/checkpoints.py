"""A trainer checkpoint as a Hugging Face model: config, tensors, tokenizer.

Each trainer engine saves in its own format (docs/engines.md):

- torch: ``trainer/torch.pt``, the module's full state dict under ``model`` (a LoRA run's: only its
  adapters, merged into the base by ``export/adapters.py``);
- fsdp: ``trainer/fsdp/``, each rank's shards (``torch.distributed.checkpoint``),
  read whole under the unsharded module's names (an earlier run's
  ``trainer/fsdp.pt``: the gathered state dict under ``model``);
- megatron: one file per rank under ``trainer/megatron/``, merged back to
  Hugging Face tensors by ``engines.megatron.hf_export``.

The model source decides the architecture: an ``hf:`` model keeps its own
(the source directory's ``config.json``, tokenizer files and generation
defaults), ``builtin:tiny-lm`` becomes a GPT-2 (``tiny_gpt2``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from rldsl.models import builtin_shape, builtin_tokenizer
from rldsl.models.base import BUILTIN_AGENT, BUILTIN_TINY
import rldsl.models.tiny_gpt2 as tiny_gpt2
from rldsl.runtime.export.writer import copy_generation_config, copy_tokenizer, transformers_offline

MODULE_STATE_ENGINES = ("torch", "fsdp")  # checkpoints that hold the model under its module's names


class ExportError(Exception):
    """Input that cannot be exported: a message and how to fix it (exit 2)."""

    def __init__(self, message: str, help_text: str | None = None):
        super().__init__(message)
        self.help_text = help_text


@dataclass
class ExportableModel:
    config: object  # a transformers PretrainedConfig
    state: dict[str, torch.Tensor]  # Hugging Face names
    write_tokenizer: Callable[[Path], None]
    source: str  # the plan's model source


def read_checkpoint(engine: str, trainer_dir: Path, source: str, state: dict | None = None) -> ExportableModel:
    """The checkpoint in ``trainer_dir`` as a model of ``source``'s architecture; ``state``: the
    weights already read (a LoRA run's, merged: export/adapters.py) under the engine's names."""
    if engine not in (*MODULE_STATE_ENGINES, "megatron"):
        raise ExportError(f"a {engine} trainer keeps no model weights, so there is nothing to export",
                          "export runs whose train stage uses engine torch, fsdp or megatron")
    if source in (BUILTIN_TINY, BUILTIN_AGENT):
        return _builtin_tiny(engine, trainer_dir, state, source)
    if source.startswith("hf:"):
        return _hf_model(engine, trainer_dir, Path(source[len("hf:"):]), state)
    raise ExportError(f"model source {source!r} cannot be exported",
                      "sources: builtin:tiny-lm, builtin:tiny-gpt2, builtin:tiny-agent, hf:<path>")


def _builtin_tiny(engine: str, trainer_dir: Path, state: dict | None, source: str) -> ExportableModel:
    """tiny-lm (or tiny-agent, its vocabulary and context) as a Hugging Face GPT-2."""
    if engine not in MODULE_STATE_ENGINES:
        raise ExportError(f"trainer.json names the {engine} engine, which does not train {source}")
    state = module_state(engine, trainer_dir) if state is None else state
    tokenizer = builtin_tokenizer(source)
    try:
        config = tiny_gpt2.tiny_config_of(state, source, tokenizer, builtin_shape(source))
    except (KeyError, ValueError) as err:
        raise ExportError(f"{trainer_dir} does not hold a {source}: {err}") from err
    transformers_offline()
    return ExportableModel(tiny_gpt2.gpt2_config(config), tiny_gpt2.tiny_to_gpt2(state, config),
                           lambda out: tiny_gpt2.save_char_tokenizer(out, tokenizer), source)


def _hf_model(engine: str, trainer_dir: Path, path: Path, state: dict | None) -> ExportableModel:
    if not (path / "config.json").is_file():
        raise ExportError(f"the run's model directory {path} is gone (no config.json): the export takes the "
                          "architecture, tokenizer and generation defaults from it",
                          "restore the directory the run's plan.json names as the policy's source")
    transformers = transformers_offline()
    config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    if state is None:
        state = _megatron_state(trainer_dir, path) if engine == "megatron" else module_state(engine, trainer_dir)

    def write_tokenizer(out: Path) -> None:
        copy_tokenizer(path, out)
        copy_generation_config(path, out)

    return ExportableModel(config, state, write_tokenizer, f"hf:{path}")


def module_state(engine: str, trainer_dir: Path) -> dict[str, torch.Tensor]:
    """The model of a torch or fsdp checkpoint; the optimizer state beside it
    is never read (a torch file is memory-mapped; fsdp shards are read by
    their metadata, fsdp/state.py)."""
    if engine == "fsdp":
        from rldsl.runtime.engines.fsdp.state import CHECKPOINT_DIR, read_model_state

        if (trainer_dir / CHECKPOINT_DIR).is_dir():
            return _read(trainer_dir / CHECKPOINT_DIR, lambda: read_model_state(trainer_dir))
    file = trainer_dir / _checkpoint_file(engine)
    if not file.is_file():
        raise ExportError(f"{file} is missing: the checkpoint is not a {engine} trainer's",
                          "check trainer.json's engine, or export another version with --version")
    return _read(file, lambda: dict(torch.load(file, map_location="cpu", weights_only=True, mmap=True)["model"]))


def _read(where: Path, read) -> dict[str, torch.Tensor]:
    try:
        return read()
    except Exception as err:  # noqa: BLE001 - a damaged file, whatever torch raises for it
        raise ExportError(f"cannot read {where}: {type(err).__name__}: {err}",
                          "export another version with --version") from err


def _checkpoint_file(engine: str) -> str:
    if engine == "fsdp":
        from rldsl.runtime.engines.fsdp.state import CHECKPOINT_FILE
    else:
        from rldsl.runtime.engines.torch.train import CHECKPOINT_FILE
    return CHECKPOINT_FILE


def _megatron_state(trainer_dir: Path, path: Path) -> dict[str, torch.Tensor]:
    from rldsl.models.hf_checkpoint import read_hf_config
    from rldsl.runtime.engines.megatron.hf_export import MegatronCheckpointError, checkpoint_to_hf
    from rldsl.runtime.engines.megatron.hf_weights import LlamaShape

    try:
        shape = LlamaShape.from_hf_config(read_hf_config(path))
    except (KeyError, NotImplementedError) as err:
        raise ExportError(f"{path}/config.json is not a model the megatron engine trains: {err}") from err
    try:
        return checkpoint_to_hf(trainer_dir, shape)
    except MegatronCheckpointError as err:
        raise ExportError(str(err), "export another version with --version") from err
