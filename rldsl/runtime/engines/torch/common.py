"""Batch helpers shared by the torch generator, logprob engine and trainer.

Every engine computes response log-probabilities with ``response_logprobs``
(one full forward over prompt + response), so the generator's behaviour
logprobs, a logprob stage and the trainer agree for the same weights. Each
takes the sampling ``temperature``: the log-probabilities are those of the
distribution the tokens were drawn from, logits / temperature (as verl and
OpenRLHF compute them; a greedy generator's, temperature 0, are the model's
own, at 1).

The log-softmax runs over slices of ``LOGPROB_SLICE_TOKENS`` positions
(``token_logprobs``): the model's logits stay in its dtype and only one
slice at a time is upcast to fp32, which for a 150k vocabulary saves more
GPU memory than any other part of a forward. Each position's log-softmax
is independent of the others, so the values equal the unsliced ones.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Mapping

import torch

from rldsl.runtime.protocols import FIELD_PROMPT_IDS, FIELD_PROMPT_MASK, FIELD_RESPONSE_IDS, FIELD_RESPONSE_MASK, Prompt

# Positions log-softmaxed in fp32 at once (rldsl.compiler.memory_model counts
# the same slice).
LOGPROB_SLICE_TOKENS = 1024


def encode_prompts(tokenizer, prompts: list[Prompt], device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids and mask (pad = 0): each prompt's tokens
    (``Prompt.tokens``: its text with BOS, or its ids as given)."""
    encoded = [prompt.tokens(tokenizer) for prompt in prompts]
    if any(not ids for ids in encoded):
        raise ValueError("a prompt encodes to no tokens; the model needs at least one to condition on")
    width = max(len(ids) for ids in encoded)
    ids = torch.zeros(len(encoded), width, dtype=torch.long)
    mask = torch.zeros(len(encoded), width, dtype=torch.long)
    for row, tokens in enumerate(encoded):
        ids[row, width - len(tokens):] = torch.tensor(tokens)
        mask[row, width - len(tokens):] = 1
    return ids.to(device), mask.to(device)


def left_align(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Move padding to the left, keeping token order (a no-op on left-padded input).

    Batches that went through a data plane may come back right-padded; the
    response must follow the last real prompt token, so we re-align.
    """
    order = torch.argsort(mask, dim=1, stable=True)
    return ids.gather(1, order), mask.gather(1, order)


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position ids counting only real tokens (0 for left padding)."""
    return (mask.long().cumsum(dim=1) - 1).clamp(min=0)


def response_logprobs(model, batch: Mapping[str, torch.Tensor], temperature: float = 1.0) -> torch.Tensor:
    """log p(response token | prefix) [n, Lr] at ``temperature``, float32, 0
    off the response mask.

    Differentiable when grad is enabled: the trainer calls it directly.
    """
    device = model.device
    prompt_ids, prompt_mask = left_align(batch[FIELD_PROMPT_IDS].to(device), batch[FIELD_PROMPT_MASK].to(device))
    response_ids = batch[FIELD_RESPONSE_IDS].to(device)
    response_mask = batch[FIELD_RESPONSE_MASK].to(device)
    ids = torch.cat([prompt_ids, response_ids], dim=1)
    mask = torch.cat([prompt_mask, response_mask], dim=1)
    logits, _ = model.forward(ids, mask, positions_from_mask(mask), use_cache=False)
    prompt_length = prompt_ids.shape[1]
    picked = token_logprobs(logits[:, prompt_length - 1 : -1], response_ids, temperature=temperature)
    return picked * response_mask.to(picked.dtype)


def logit_divisor(temperature: float) -> float:
    """What logits are divided by for the log-probabilities of sampling at
    ``temperature``: itself, or 1 for greedy decoding (0)."""
    return temperature if temperature > 0 else 1.0


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, slice_tokens: int = LOGPROB_SLICE_TOKENS,
                   temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / temperature)[target] in fp32, for logits [rows,
    positions, vocab] or [positions, vocab] and targets of the leading shape.
    Slices are views of the logits, upcast (and scaled) one at a time.
    Differentiable."""
    divisor = logit_divisor(temperature)
    if logits.dim() == 2:
        return _row_token_logprobs(logits, targets, slice_tokens, divisor)
    rows = [_row_token_logprobs(row, row_targets, slice_tokens, divisor) for row, row_targets in zip(logits, targets)]
    return torch.stack(rows) if rows else logits.new_zeros(targets.shape, dtype=torch.float32)


def _row_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, slice_tokens: int,
                        divisor: float = 1.0) -> torch.Tensor:
    """One row [positions, vocab], ``slice_tokens`` positions at a time."""
    slices = [torch.log_softmax(_scaled(logits[start:start + slice_tokens].float(), divisor), dim=-1)
              .gather(-1, targets[start:start + slice_tokens, None]).squeeze(-1)
              for start in range(0, len(targets), slice_tokens)]
    return torch.cat(slices) if slices else logits.new_zeros(0, dtype=torch.float32)


def _scaled(logits: torch.Tensor, divisor: float) -> torch.Tensor:
    return logits if divisor == 1.0 else logits / divisor


def packed_response_logprobs(model, batch: Mapping[str, torch.Tensor], temperature: float = 1.0) -> torch.Tensor:
    """``response_logprobs`` with every row's real tokens packed into one row
    (no padding): the same values, [n, Lr], differentiable. Positions restart
    at each sequence and no attention mask is passed, from which transformers
    (Hugging Face models) and the builtin tiny model both mask attention
    block-diagonally."""
    prompt_lengths = batch[FIELD_PROMPT_MASK].sum(dim=1).cpu()
    response_mask = batch[FIELD_RESPONSE_MASK]
    response_lengths = response_mask.sum(dim=1).cpu()
    if int(response_lengths.sum()) == 0:
        return torch.zeros(response_mask.shape, device=model.device)
    ids, positions, starts = _packed_row(batch, prompt_lengths, response_lengths)
    device = model.device
    ids = ids.to(device)
    logits, _ = model.forward(ids[None], None, positions.to(device)[None], use_cache=False)
    next_logprobs = token_logprobs(logits[0, :-1], ids[1:], temperature=temperature)
    # Response token j of a row sits at start + prompt + j and is predicted one position earlier.
    first = (starts + prompt_lengths - 1).to(device)
    index = first[:, None] + torch.arange(response_mask.shape[1], device=device)[None]
    picked = next_logprobs[index.clamp(max=len(next_logprobs) - 1)]
    return picked * response_mask.to(device=device, dtype=picked.dtype)


def _packed_row(batch, prompt_lengths, response_lengths):
    """The real tokens of every row back to back, positions restarting at each
    row, and each row's start offset."""
    prompt_ids, prompt_mask = batch[FIELD_PROMPT_IDS].cpu(), batch[FIELD_PROMPT_MASK].cpu()
    response_ids = batch[FIELD_RESPONSE_IDS].cpu()
    pieces = [torch.cat([prompt_ids[row][prompt_mask[row].bool()], response_ids[row, : int(response_lengths[row])]])
              for row in range(len(prompt_ids))]
    lengths = prompt_lengths + response_lengths
    starts = torch.cumsum(lengths, dim=0) - lengths
    positions = torch.cat([torch.arange(int(length)) for length in lengths])
    return torch.cat(pieces), positions, starts


def split_rows(batch: Mapping[str, torch.Tensor], rows_per_chunk: int | None) -> Iterator[dict]:
    """The batch in chunks of at most ``rows_per_chunk`` rows (all at once if None)."""
    size = len(batch[FIELD_RESPONSE_IDS])
    step = rows_per_chunk or max(size, 1)
    for start in range(0, size, step):
        yield {name: value[start : start + step] for name, value in batch.items()}


def decode_responses(tokenizer, batch: Mapping[str, torch.Tensor]) -> list[str]:
    """Response texts of a generated batch (tokens off the mask are ignored)."""
    ids, mask = batch[FIELD_RESPONSE_IDS], batch[FIELD_RESPONSE_MASK]
    return [tokenizer.decode(row[row_mask.bool()].tolist()) for row, row_mask in zip(ids, mask)]


def state_buckets(module: torch.nn.Module, bucket_bytes: int,
                  on_host: bool = True) -> Iterator[dict[str, torch.Tensor]]:
    """What a push carries (the state dict, or only the LoRA adapters: ``trained_state``)
    in buckets of at most ``bucket_bytes`` (a tensor larger than that travels alone): CPU
    copies, or with ``on_host`` false the module's own tensors where they are (a stream
    packs them into its payload on the group's device: no host round trip)."""
    from rldsl.models.hf_layout import checkpoint_named
    from rldsl.models.lora import trained_state

    # a mixture of experts' fused parameters travel as each expert's tensors, under checkpoint names
    return tensor_buckets(checkpoint_named(trained_state(module).items()), bucket_bytes, on_host)


def tensor_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                   on_host: bool = True) -> Iterator[dict[str, torch.Tensor]]:
    """``(name, tensor)`` pairs in buckets of at most ``bucket_bytes``: CPU copies, or the tensors
    themselves (detached, not copied) without ``on_host``."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket, used = {}, 0
    for name, tensor in named:
        size = tensor.numel() * tensor.element_size()
        if bucket and used + size > bucket_bytes:
            yield bucket
            bucket, used = {}, 0
        bucket[name] = tensor.detach().to("cpu", copy=True) if on_host else tensor.detach()
        used += size
    if bucket:
        yield bucket


class WeightReceiver:
    """In-place weight updates and sleep/wake for engines that hold a model copy.

    A sync arrives as several ``update_weights`` calls; the version changes at
    the last one. Between the first and the last bucket the weights are mixed,
    so ``require_consistent_weights`` refuses to compute until the sync ends.
    """

    model = None  # set by the engine
    version: int = 0
    _pending_version: int | None = None
    _home_device = None

    def update_weights(self, bucket: Mapping[str, torch.Tensor], version: int, last: bool) -> None:
        if self._pending_version not in (None, version):
            raise RuntimeError(
                f"weight bucket for version {version} arrived while version {self._pending_version} "
                "was half applied; a sync must finish (last=True) before the next begins"
            )
        from rldsl.models.hf_layout import runtime_view

        targets = self.model.module.state_dict()
        with torch.no_grad():
            for name, tensor in bucket.items():
                target = targets.get(name)
                if target is None:
                    target = runtime_view(name, targets)  # an expert's tensor: its slice of the fused parameter
                if target is None:
                    raise KeyError(f"weight {name!r} is not in this engine's model")
                if target.shape != tensor.shape:
                    raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)} != {tuple(target.shape)}")
                target.copy_(tensor)
        self._pending_version = None if last else version
        if last:
            self.version = version

    def require_consistent_weights(self) -> None:
        if self._pending_version is not None:
            raise RuntimeError(
                f"weight sync to version {self._pending_version} is in progress (last bucket not received)"
            )

    def sleep(self) -> None:
        """Move the weights to CPU memory to free the accelerator; a no-op on CPU."""
        if self.model.device.type != "cpu":
            self._home_device = self.model.device
            self.model.to("cpu")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def wake(self) -> None:
        if self._home_device is not None:
            self.model.to(self._home_device)
            self._home_device = None


def init_one_process_group(backend: str) -> None:
    """torch.distributed's default group of this process alone, for engines
    that need one on a single rank (FSDP, megatron). Its store is in memory:
    a TCP store on a free port could lose the port to another process
    between the probe and the bind."""
    import torch.distributed as dist

    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
