"""``builtin:tiny-lm`` as a stock Hugging Face GPT-2 (``GPT2LMHeadModel``),
and ``builtin:tiny-gpt2``: the builtin model with one attention head of 64
(``TINY_GPT2_SHAPE``) kept in that form, which every engine loads by path:
vLLM (its CPU attention takes no head under 64 wide), transformers, the torch
engines (as an `hf:` model). rldsl writes it (``save_gpt2``); nothing is
downloaded. The exporter (`rldsl export`) writes a tiny-lm run with the same
mapping.

The two compute the same function, term by term:

- token + learned position embeddings (``wte`` + ``wpe``), no scaling;
- pre-norm blocks ``x + attn(ln_1(x))``, ``x + mlp(ln_2(x))`` with
  ``nn.LayerNorm`` (eps 1e-5, weight and bias), a final LayerNorm ``ln_f``;
- attention with one fused q/k/v projection whose outputs are
  ``[q; k; v]``, each split into heads in order, scores scaled by
  ``1 / sqrt(head_dim)`` only (no per-layer scaling), bias on q/k/v and on
  the output projection;
- an MLP ``Linear -> GELU -> Linear`` with biases, where the GELU is the
  exact (erf) one: GPT-2's ``activation_function = "gelu"``, not its
  default tanh approximation ``gelu_new``;
- an output head tied to the token embedding, no bias;
- no dropout.

GPT-2 keeps its linears as ``Conv1D`` (``y = x @ W + b``, ``W`` is
``[in, out]``), so every tiny-lm ``nn.Linear`` weight is transposed.

The character tokenizer becomes a ``tokenizers`` WordLevel model over the
same ids (pad, bos, eos, unk, then one token per character), splitting
text into characters; ``tokenizer(text)`` prepends ``<bos>`` as rldsl does
for prompts, ``add_special_tokens=False`` gives the bare ids.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rldsl.models.base import BUILTIN_TINY
from rldsl.models.tiny import TinyLMConfig
from rldsl.models.tokenizer import BOS, EOS, PAD, SPECIAL_TOKENS, UNK, CharTokenizer

ARCHITECTURE = "GPT2LMHeadModel"
LAYER_NORM_EPS = 1e-5  # torch.nn.LayerNorm's default, which tiny-lm uses
TINY_GPT2 = "builtin:tiny-gpt2"
TINY_GPT2_SHAPE = {"d_model": 128, "n_heads": 2}  # TinyLMConfig overrides: heads 64 wide


def tiny_config_of(state: dict[str, torch.Tensor], source: str = BUILTIN_TINY, tokenizer: CharTokenizer | None = None,
                   shape: dict | None = None) -> TinyLMConfig:
    """The config the plan's builtin model ``source`` (tiny-lm; or tiny-agent,
    with its ``tokenizer`` and ``shape``) was built with (the language has no
    setting to change it), checked against the saved tensors."""
    config = TinyLMConfig(vocab_size=(tokenizer or CharTokenizer()).vocab_size, **(shape or {}))
    layers = {name.split(".")[1] for name in state if name.startswith("blocks.")}
    found = {"vocab_size": tuple(state["token_embedding.weight"].shape), "layers": len(layers),
             "max_positions": tuple(state["position_embedding.weight"].shape),
             "d_ff": tuple(state["blocks.0.mlp.0.weight"].shape)}
    expected = {"vocab_size": (config.vocab_size, config.d_model), "layers": config.n_layers,
                "max_positions": (config.max_positions, config.d_model), "d_ff": (config.d_ff, config.d_model)}
    if found != expected:
        raise ValueError(f"the checkpoint's model has shapes {found}, {source} {expected}")
    return config


def gpt2_config(config: TinyLMConfig):
    from transformers import GPT2Config

    tokenizer = CharTokenizer()
    return GPT2Config(
        vocab_size=config.vocab_size, n_positions=config.max_positions, n_embd=config.d_model,
        n_layer=config.n_layers, n_head=config.n_heads, n_inner=config.d_ff,
        activation_function="gelu", layer_norm_epsilon=LAYER_NORM_EPS,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id,
        pad_token_id=tokenizer.pad_id, architectures=[ARCHITECTURE],
    )


def tiny_to_gpt2(state: dict[str, torch.Tensor], config: TinyLMConfig) -> dict[str, torch.Tensor]:
    """tiny-lm's state dict under GPT-2's names and layouts (the tied head included)."""
    gpt2 = {"transformer.wte.weight": state["token_embedding.weight"],
            "transformer.wpe.weight": state["position_embedding.weight"],
            "transformer.ln_f.weight": state["final_norm.weight"],
            "transformer.ln_f.bias": state["final_norm.bias"],
            "lm_head.weight": state["token_embedding.weight"]}
    for layer in range(config.n_layers):
        gpt2.update(_block(state, f"blocks.{layer}.", f"transformer.h.{layer}."))
    return gpt2


def _block(state: dict[str, torch.Tensor], tiny: str, gpt2: str) -> dict[str, torch.Tensor]:
    linears = {"attn.qkv": "attn.c_attn", "attn.out": "attn.c_proj", "mlp.0": "mlp.c_fc", "mlp.2": "mlp.c_proj"}
    norms = {"norm_attn": "ln_1", "norm_mlp": "ln_2"}
    out = {}
    for source, target in linears.items():
        out[f"{gpt2}{target}.weight"] = state[f"{tiny}{source}.weight"].t().contiguous()  # Conv1D is [in, out]
        out[f"{gpt2}{target}.bias"] = state[f"{tiny}{source}.bias"]
    for source, target in norms.items():
        for part in ("weight", "bias"):
            out[f"{gpt2}{target}.{part}"] = state[f"{tiny}{source}.{part}"]
    return out


def save_char_tokenizer(out: Path, char: CharTokenizer | None = None) -> None:
    """A builtin character tokenizer (default: tiny-lm's) as ``tokenizer.json`` +
    a fast tokenizer's config files."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    char = char or CharTokenizer()
    vocab = {token: index for index, token in enumerate([*SPECIAL_TOKENS, *char.characters])}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=UNK))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")  # one token per character
    model.decoder = tokenizers.decoders.Fuse()  # characters back to back, no separator
    model.post_processor = tokenizers.processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, char.bos_id)])
    wrapped = PreTrainedTokenizerFast(tokenizer_object=model, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                      unk_token=UNK)
    wrapped.save_pretrained(out)


def save_gpt2(model, out: Path) -> Path:
    """``model`` (a tiny-lm ``CausalLM``) as a Hugging Face GPT-2 directory in
    ``out``: config.json, the weights, the character tokenizer."""
    from transformers import GenerationConfig, GPT2LMHeadModel

    config = TinyLMConfig(**model.config)
    gpt2 = GPT2LMHeadModel(gpt2_config(config))
    gpt2.load_state_dict(tiny_to_gpt2(model.module.state_dict(), config))
    out.mkdir(parents=True, exist_ok=True)
    gpt2.save_pretrained(out)
    GenerationConfig.from_model_config(gpt2.config).save_pretrained(out)
    save_char_tokenizer(out)
    return out
