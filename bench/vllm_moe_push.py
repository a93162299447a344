"""A mixture of experts pushed into vLLM's CPU build: its log-probabilities
against transformers', at start, after a push through rldsl's path and after
vLLM's own reload of the same weights.

For each ``--moe-sizes`` value a random tiny Qwen3-MoE (4 experts, top 2,
head_dim 64, fp32) with that ``moe_intermediate_size`` is saved and served by
vLLM with rldsl's worker extension. New weights (the model plus noise) then
go in twice: as a generator's push does (each expert under its checkpoint
name, one safetensors bucket in shared memory, ``rldsl_load_bucket``: vLLM's
layer-wise reload) and through vLLM's ``reload_weights`` from a saved
directory. Printed per size: the largest |log p| gap to transformers over
4 prompts of 20 tokens, at start and after each. ``--dense``: a Qwen3 of the
same sizes without experts, for comparison.

    python bench/vllm_moe_push.py [--moe-sizes 32,64] [--dense]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CONFIG = dict(vocab_size=128, hidden_size=128, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=64, max_position_embeddings=64, rms_norm_eps=1e-6,
              tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2)


def tiny_model(moe_size: int, directory: Path, dense: bool = False):
    import torch
    import transformers

    torch.manual_seed(0)
    if dense:
        config = {k: v for k, v in CONFIG.items() if k not in ("num_experts", "num_experts_per_tok")}
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**config))
    else:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**CONFIG, moe_intermediate_size=moe_size))
    model.save_pretrained(directory)
    return model


def transformers_logprobs(model, prompts):
    import torch

    ids = torch.tensor(prompts)
    with torch.no_grad():
        logits = model(ids).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]


def vllm_logprobs(llm, prompts):
    import torch
    from vllm import SamplingParams

    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1, prompt_logprobs=0),
                           use_tqdm=False)
    return torch.tensor([[entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], prompt[1:])]
                         for out, prompt in zip(outputs, prompts)])


def perturbed(model) -> None:
    import torch

    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))


def push_bucket(llm, model, directory: Path) -> None:
    """The model's weights as one bucket under checkpoint names (each expert its own), loaded in place."""
    from safetensors.torch import save_file

    from rldsl.models.hf_layout import checkpoint_tensors
    from rldsl.runtime.engines.vllm_worker import LOAD_BUCKET_RPC

    tensors = {part: value.contiguous() for name, tensor in model.state_dict().items()
               for part, value in checkpoint_tensors(name, tensor)}
    path = directory / "bucket.safetensors"
    save_file(tensors, str(path))
    llm.collective_rpc(LOAD_BUCKET_RPC, args=(str(path), True, True))


def measure(moe_size: int, work: Path, dense: bool = False) -> dict:
    import torch
    from vllm import LLM

    directory = work / f"moe{moe_size}"
    model = tiny_model(moe_size, directory, dense)
    llm = LLM(model=str(directory), skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
              kv_cache_memory_bytes=64 << 20, max_model_len=64, seed=0,
              worker_extension_cls="rldsl.runtime.engines.vllm_worker.BucketLoader")
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, CONFIG["vocab_size"], (20,), generator=generator).tolist() for _ in range(4)]
    gap = lambda: float((vllm_logprobs(llm, prompts) - transformers_logprobs(model, prompts)).abs().max())  # noqa: E731
    found = {"start": gap()}
    perturbed(model)
    push_bucket(llm, model, work)
    found["rldsl push"] = gap()
    perturbed(model)
    model.save_pretrained(work / "reloaded")
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(work / "reloaded")})
    found["vLLM reload_weights"] = gap()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--moe-sizes", default="32,64")
    parser.add_argument("--dense", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one engine after another in this process
    for size in map(int, args.moe_sizes.split(",")):
        with tempfile.TemporaryDirectory(prefix="vllm-moe-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None) \
                as work:
            found = measure(size, Path(work), args.dense)
        print(f"{'dense, intermediate_size 64' if args.dense else f'moe_intermediate_size {size}'}: "
              "max |log p - transformers'| "
              + ", ".join(f"{name} {value:.1e}" for name, value in found.items()), flush=True)


if __name__ == "__main__":
    main()
