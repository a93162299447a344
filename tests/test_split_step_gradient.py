"""Split-step training equals one full-batch backward, at dp=1, 2 and 4 (gloo),
under every loss aggregation.

The reference is one backward over the whole global batch of
``loss_sum / N``; the trainer instead sees the rows as uneven microbatches
(spread unevenly over ranks, and with a token budget split into forwards of
its own choosing), backpropagates un-normalised sums, and divides by the
all-reduced N at finish.
"""

import copy
import os

import pytest

from tests.ports import free_port, start_ranks
import torch

from rldsl.models.tiny import build_tiny_lm
from rldsl.runtime.engines.policy_loss import AGGREGATIONS, PolicyLossConfig, policy_loss
from rldsl.runtime.engines.torch.common import response_logprobs
from rldsl.runtime.engines.torch.train import TorchTrainer

ROWS = 10
LOSS_CONFIGS = [PolicyLossConfig(clip=0.2, kl=0.05, agg=agg) for agg in AGGREGATIONS]


def make_model():
    return build_tiny_lm(seed=3, d_model=32, n_layers=2, n_heads=2, d_ff=64)


def make_batch(model) -> dict:
    """A fixed batch with uneven prompt and response lengths and ratios != 1."""
    gen = torch.Generator().manual_seed(7)
    prompt_len, response_len = 6, 5
    prompt_ids = torch.randint(4, model.tokenizer.vocab_size, (ROWS, prompt_len), generator=gen)
    prompt_mask = torch.ones_like(prompt_ids)
    response_ids = torch.randint(4, model.tokenizer.vocab_size, (ROWS, response_len), generator=gen)
    response_mask = torch.zeros_like(response_ids)
    for row in range(ROWS):
        pad = row % 4  # left padding of the prompt
        prompt_ids[row, :pad], prompt_mask[row, :pad] = 0, 0
        length = 1 + (row * 3) % response_len
        response_mask[row, :length] = 1
    response_ids = response_ids * response_mask
    batch = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "response_ids": response_ids,
        "response_mask": response_mask,
    }
    with torch.no_grad():
        current = response_logprobs(model, batch)
    noise = lambda: 0.3 * torch.randn(current.shape, generator=gen)  # noqa: E731
    batch["behaviour_logprobs"] = (current + noise()) * response_mask
    batch["ref_logprobs"] = (current + noise()) * response_mask
    batch["advantage"] = torch.randn(ROWS, generator=gen)
    return batch


def full_batch_gradients(model, batch, config) -> list[torch.Tensor]:
    model = copy.deepcopy(model)
    logprobs = response_logprobs(model, batch)
    out = policy_loss(
        logprobs, batch["behaviour_logprobs"], batch["advantage"], batch["response_mask"], config, batch["ref_logprobs"]
    )
    (out.loss_sum / out.count).backward()
    return [p.grad.clone() for p in model.module.parameters()]


def split_step_gradients(model, batch, config, row_splits: list[tuple[int, int]], **options) -> list[torch.Tensor]:
    trainer = TorchTrainer(copy.deepcopy(model), loss=config, lr=0.0, max_grad_norm=None, **options)
    trainer.begin_train_step(0)
    for start, stop in row_splits:
        trainer.train_microbatch(0, {name: value[start:stop] for name, value in batch.items()})
    result = trainer.finish_train_step(0)
    assert result.version == 1
    return [p.grad.clone() for p in trainer.parameters]


def max_relative_error(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    scale = max(float(g.abs().max()) for g in expected)
    return max(float((a - e).abs().max()) for a, e in zip(actual, expected)) / scale


@pytest.mark.parametrize("config", LOSS_CONFIGS, ids=lambda c: c.agg)
def test_split_step_equals_full_batch_dp1(config):
    model = make_model()
    batch = make_batch(model)
    expected = full_batch_gradients(model, batch, config)
    actual = split_step_gradients(model, batch, config, [(0, 3), (3, 4), (4, 9), (9, 10)])
    assert max_relative_error(actual, expected) < 1e-5


@pytest.mark.parametrize("config", LOSS_CONFIGS, ids=lambda c: c.agg)
@pytest.mark.parametrize("budget", [1, 12, 25])  # 1: every row alone (each is longer); 25: several rows a forward
def test_split_step_with_a_token_budget_equals_full_batch(config, budget):
    model = make_model()
    batch = make_batch(model)
    expected = full_batch_gradients(model, batch, config)
    actual = split_step_gradients(model, batch, config, [(0, 6), (6, 10)], tokens_per_forward=budget)
    assert max_relative_error(actual, expected) < 1e-5


# rank -> microbatch row ranges; ranks hold different, uneven numbers of microbatches
DP_LAYOUTS = {
    2: {
        "uneven": {0: [(0, 2), (2, 3), (3, 7)], 1: [(7, 10)]},
        "idle rank": {0: [(0, 4), (4, 10)], 1: []},
    },
    4: {"uneven": {0: [(0, 1), (1, 2)], 1: [(2, 6)], 2: [(6, 7), (7, 9)], 3: [(9, 10)]}},
}


def lanes_layout(world_size: int, model) -> dict[int, list[tuple[int, int]]]:
    """Two-row groups assigned to ranks as the controller's lanes assign them
    (equal counts per rank, balanced by response tokens)."""
    from rldsl.runtime.control.lanes import MicrobatchLanes

    tokens = make_batch(model)["response_mask"].sum(dim=1).tolist()
    groups = [(start, start + 2) for start in range(0, ROWS, 2)]
    lanes = MicrobatchLanes(world_size, lambda: None)
    lanes.open_step(len(groups))
    layout: dict[int, list[tuple[int, int]]] = {rank: [] for rank in range(world_size)}
    for start, stop in groups:
        layout[lanes.assign(int(sum(tokens[start:stop])))].append((start, stop))
    return layout


def _dp_worker(rank: int, world_size: int, port: int, results: dict):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        torch.set_num_threads(1)
        model = make_model()
        batch = make_batch(model)
        layouts = {**DP_LAYOUTS[world_size], "lanes": lanes_layout(world_size, model)}
        for config in LOSS_CONFIGS:
            expected = full_batch_gradients(model, batch, config)
            for name, layout in layouts.items():
                actual = split_step_gradients(model, batch, config, layout[rank])
                results[(rank, config.agg, name)] = max_relative_error(actual, expected)
    finally:
        torch.distributed.destroy_process_group()



@pytest.mark.parametrize("world_size", [2, 4])
def test_split_step_equals_full_batch_data_parallel_gloo(world_size):
    results = start_ranks(_dp_worker, (world_size, free_port()), nprocs=world_size)
    assert len(results) == world_size * len(LOSS_CONFIGS) * (len(DP_LAYOUTS[world_size]) + 1)
    worst = max(results.values())
    assert worst < 1e-5, results
