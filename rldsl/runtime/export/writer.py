"""A Hugging Face model directory from a config and a full state dict.

transformers' own ``save_pretrained`` writes it, so the layout is the stock
one: ``config.json``, ``generation_config.json``, ``model.safetensors`` (or
``model-0000N-of-0000M.safetensors`` and ``model.safetensors.index.json``
past ``max_shard_size``), tied tensors stored once. The model is built on
the meta device and takes the given tensors as its parameters, so no
second copy of the weights is allocated; loading them first is also what
checks that every tensor has a place in the architecture and the right
shape.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import torch

from rldsl.models.hf_layout import fused_state

DEFAULT_SHARD_SIZE = "5GB"
# What a tokenizer may consist of, whichever kind it is (fast, sentencepiece, BPE vocab + merges).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja",
                   "chat_template.json", "spiece.model")


def transformers_offline():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded
    import transformers

    transformers.utils.logging.disable_progress_bar()
    return transformers


def save_model(out: Path, config, state: dict[str, torch.Tensor], max_shard_size: str = DEFAULT_SHARD_SIZE) -> str:
    """Write ``state`` as the model ``config`` describes; returns the architecture's class name."""
    transformers = transformers_offline()
    config.dtype = _dtype_of(state)  # config.json says what the files hold
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    # a mixture of experts exported under checkpoint names (megatron's): stacked as transformers fuses them
    state = fused_state(state, model.state_dict())
    loaded = model.load_state_dict(state, strict=False, assign=True)
    if loaded.unexpected_keys:
        raise ValueError(f"{len(loaded.unexpected_keys)} checkpoint tensors have no place in "
                         f"{type(model).__name__}, e.g. {loaded.unexpected_keys[:3]}")
    model.tie_weights()
    unset = [name for name, tensor in model.state_dict().items() if tensor.is_meta]
    if unset:
        raise ValueError(f"the checkpoint has no value for {len(unset)} tensors of {type(model).__name__}, "
                         f"e.g. {unset[:3]}")
    model.save_pretrained(out, max_shard_size=max_shard_size)
    if not (out / "generation_config.json").exists():
        transformers.GenerationConfig.from_model_config(config).save_pretrained(out)
    _weights_readable_like_the_rest(out)
    return type(model).__name__


def _weights_readable_like_the_rest(out: Path) -> None:
    """The weight files get the mode of the export's other files (``config.json``:
    0644 under the usual umask): safetensors writes them through a private
    temporary file (0600), so a model shared with others would not load."""
    mode = stat.S_IMODE((out / "config.json").stat().st_mode)
    for path in out.glob("*.safetensors"):
        path.chmod(mode)


def _dtype_of(state: dict[str, torch.Tensor]) -> torch.dtype:
    floats = [tensor.dtype for tensor in state.values() if tensor.is_floating_point()]
    return max(set(floats), key=floats.count)


def copy_tokenizer(source: Path, out: Path) -> list[str]:
    """The source model's tokenizer files, as they are; returns their names."""
    copied = [name for name in TOKENIZER_FILES if (source / name).is_file()]
    for name in copied:
        shutil.copyfile(source / name, out / name)
    return copied


def copy_generation_config(source: Path, out: Path) -> None:
    """The source's sampling defaults and stop tokens win over those derived from its config."""
    if (source / "generation_config.json").is_file():
        shutil.copyfile(source / "generation_config.json", out / "generation_config.json")


def size_on_disk(out: Path) -> int:
    return sum(path.stat().st_size for path in out.glob("*.safetensors"))
