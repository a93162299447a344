"""Reward models: a sequence classifier that scores, or a language model
that answers a judge prompt (docs/engines.md, Reward models).

- ``ScoreJudge``: an ``hf:`` ``AutoModelForSequenceClassification`` with one
  label; the logit of (prompt, response) is the reward. The pair goes
  through the tokenizer's chat template (a user turn, the assistant's
  answer) when it has one, else the two texts are joined.
- ``GenerativeJudge``: the builtin model or an ``hf:`` causal LM on the
  torch engine, decoding greedily (``TorchGenerator.generate_greedy``).
- ``VLLMGenerativeJudge``: the same on vLLM's offline engine (imported when
  built; GPU machines only).

Both judges are frozen: no weights ever reach them. A judge only computes;
templates, parsers and failures are the caller's (the reward stage's worker).
"""

from __future__ import annotations

from typing import Sequence

from rldsl.runtime.protocols import Prompt

TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def dtype_argument() -> str:
    """`from_pretrained`'s dtype keyword: `torch_dtype` was renamed `dtype` in transformers 4.56."""
    import transformers

    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def _device():
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class ScoreJudge:
    def __init__(self, path: str, dtype: str = "fp32", rows_per_forward: int = 8, device: str | None = None):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.rows_per_forward = max(1, rows_per_forward)
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.tokenizer.padding_side = "right"
        if self.tokenizer.pad_token_id is None:  # many causal checkpoints have none; masked rows never score
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path, local_files_only=True, **{dtype_argument(): getattr(torch, TORCH_DTYPES[dtype])})
        if self.model.config.num_labels != 1:
            raise ValueError(f"hf:{path} has {self.model.config.num_labels} labels; a reward model has one")
        if self.model.config.pad_token_id is None:  # the classifier finds each row's last token by it
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.to(device or _device()).eval()

    def text(self, prompt: str, response: str) -> str:
        if getattr(self.tokenizer, "chat_template", None):
            turns = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
            return self.tokenizer.apply_chat_template(turns, tokenize=False)
        return prompt + response

    def score(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        """One reward per (prompt, response), ``rows_per_forward`` rows a forward."""
        import torch

        texts = [self.text(prompt, response) for prompt, response in pairs]
        rewards: list[float] = []
        with torch.no_grad():
            for start in range(0, len(texts), self.rows_per_forward):
                batch = self.tokenizer(texts[start:start + self.rows_per_forward], return_tensors="pt", padding=True)
                batch = {k: v.to(self.model.device) for k, v in batch.items()}
                rewards += self.model(**batch).logits[:, 0].float().tolist()
        return rewards


class GenerativeJudge:
    """Greedy answers to judge prompts, ``rows_per_forward`` prompts a decode."""

    def __init__(self, model, max_new_tokens: int, rows_per_forward: int = 8, device: str | None = None):
        from rldsl.runtime.engines.torch.generate import TorchGenerator

        model.to(device or _device())  # the rank's GPU when it has one
        self.generator = TorchGenerator(model, max_new_tokens=max_new_tokens, temperature=0.0)
        self.rows_per_forward = max(1, rows_per_forward)

    def answer(self, texts: Sequence[str]) -> list[str]:
        answers: list[str] = []
        for start in range(0, len(texts), self.rows_per_forward):
            chunk = texts[start:start + self.rows_per_forward]
            answers += self.generator.generate_greedy([Prompt(start + i, text, "") for i, text in enumerate(chunk)])
        return answers


class VLLMGenerativeJudge:
    """A generating judge on vLLM: one replica (tp x pp GPUs), greedy."""

    def __init__(self, path: str, options, seed: int, max_new_tokens: int):
        from rldsl.runtime.engines.vllm import VLLMGenerator

        self.generator = VLLMGenerator.from_path(path, options, seed, max_new_tokens=max_new_tokens, temperature=0.0)

    def answer(self, texts: Sequence[str]) -> list[str]:
        return self.generator.generate_greedy([Prompt(i, text, "") for i, text in enumerate(texts)])
