"""``hf:<local path>``: a local Hugging Face causal LM behind ``CausalLM``.

transformers is imported only here, and only when such a model is asked for.
Nothing is downloaded: ``HF_HUB_OFFLINE=1`` is set before the import.
"""

from __future__ import annotations

import os
from pathlib import Path

from rldsl.models.base import CausalLM


class HFTokenizer:
    """The subset of a Hugging Face tokenizer the engines use."""

    def __init__(self, tokenizer):
        self.inner = tokenizer
        if tokenizer.eos_token_id is None:
            raise ValueError("the Hugging Face tokenizer has no eos_token_id; generation could never stop")
        self.eos_id = tokenizer.eos_token_id
        self.bos_id = tokenizer.bos_token_id
        self.pad_id = 0  # rldsl batches pad with 0 and carry masks, so the id is never read
        self.vocab_size = len(tokenizer)

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = self.inner(text, add_special_tokens=False)["input_ids"]
        templated = bool(ids) and ids[0] == self.bos_id  # a chat template already opened with BOS
        prefix = [self.bos_id] if add_bos and self.bos_id is not None and not templated else []
        return prefix + ids + ([self.eos_id] if add_eos else [])

    def decode(self, ids, stop_at_eos: bool = True) -> str:
        ids = [int(token) for token in ids]
        if stop_at_eos and self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return self.inner.decode(ids, skip_special_tokens=True)


class HFCausalLM(CausalLM):
    def forward(self, input_ids, attention_mask, position_ids, cache=None, use_cache=True):
        output = self.module(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=use_cache,
        )
        return output.logits, output.past_key_values if use_cache else None


def _import_transformers():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers
    except ImportError as error:
        raise ImportError(
            "model source 'hf:...' needs the transformers package: pip install transformers"
        ) from error
    return transformers


def load_hf_model(path: str, device="cpu", dtype: str = "float32", **kwargs) -> HFCausalLM:
    import torch

    if not Path(path).is_dir():
        raise FileNotFoundError(f"hf:{path}: no such local directory (models are never downloaded)")
    transformers = _import_transformers()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    dtype_argument = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"  # renamed in 4.56
    kwargs[dtype_argument] = getattr(torch, dtype)
    module = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True, **kwargs)
    module.to(device)
    return HFCausalLM(module, HFTokenizer(tokenizer), f"hf:{path}", module.config.to_dict())
