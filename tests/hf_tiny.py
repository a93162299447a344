"""A tiny local Hugging Face Llama with a character tokenizer (nothing is
downloaded), for the tests that load ``hf:<path>`` models."""

from __future__ import annotations

from pathlib import Path


def save_char_llama(path: Path, seed: int = 0, vocab_multiple: int = 1, extra_tokens: tuple[str, ...] = (),
                    architecture: str = "Llama", **config) -> Path:
    """Tokenizer + random weights in ``path``; the vocabulary is padded with
    unused tokens to a multiple of ``vocab_multiple`` (tensor parallelism
    splits it evenly). ``extra_tokens``: more characters, or words read as
    one token (such as ``<tool_call>``). ``architecture``: transformers'
    ``{architecture}Config`` / ``{architecture}ForCausalLM`` (``Qwen3Moe``)."""
    import tokenizers
    import torch
    import transformers

    from rldsl.models.tokenizer import SPECIAL_TOKENS, CharTokenizer

    path.mkdir(parents=True, exist_ok=True)
    tokens = [*SPECIAL_TOKENS, *CharTokenizer().characters, *extra_tokens]
    tokens += [f"<unused{i}>" for i in range(-len(tokens) % vocab_multiple)]
    vocab = {token: i for i, token in enumerate(tokens)}
    char_tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    char_tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    char_tokenizer.decoder = tokenizers.decoders.Fuse()
    char_tokenizer.save(str(path / "tokenizer.json"))
    special = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), **special)
    fast.add_tokens([token for token in extra_tokens if len(token) > 1])  # matched whole, before the split
    fast.save_pretrained(path)
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, max_position_embeddings=64)
    built = getattr(transformers, f"{architecture}Config")(vocab_size=len(vocab), bos_token_id=1, eos_token_id=2,
                                                           pad_token_id=0, **{**shape, **config})
    torch.manual_seed(seed)
    getattr(transformers, f"{architecture}ForCausalLM")(built).save_pretrained(path)
    return path
