"""What the conformance tests (tests/test_conformance_*.py) share.

They compare rldsl's loss and advantages with the peers' own functions,
imported from the peers' installed packages (``pip install 'rldsl[conformance]'``
plus the ``--no-deps`` lines of ``INSTALL``), on seeded random batches in
float64: the loss value and its gradient with respect to the trainer's
logprobs must agree within ``TOLERANCE``. A peer that does not import skips
its file with the reason and the install line.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.util
import logging
import sys
import types
from dataclasses import dataclass

import pytest
import torch

from rldsl.runtime.engines.policy_loss import PolicyLossConfig, policy_loss

TOLERANCE = 1e-5
# The versions compared (docs/migrating.md names them); verl, OpenRLHF and AReaL pin torch and transformers
# versions this project does not run, so they install without their dependencies.
INSTALL = {
    "trl": "pip install 'rldsl[conformance]'  (trl==1.16.0)",
    "verl": "pip install --no-deps verl==0.9.1  (after rldsl[conformance])",
    "openrlhf": "pip install --no-deps openrlhf==0.11.0 && DS_BUILD_OPS=0 pip install --no-deps "
                "--no-build-isolation deepspeed==0.19.6  (after rldsl[conformance])",
    "areal": "pip install --no-deps areal==1.0.4  (after rldsl[conformance])",
}


def import_peer(peer: str, *modules: str) -> list[types.ModuleType]:
    """The peer's modules, or the calling test module skipped saying why."""
    try:
        with logging_kept():
            return [importlib.import_module(name) for name in modules]
    except ImportError as error:
        pytest.skip(f"{peer} is not importable here ({error}); install: {INSTALL[peer]}", allow_module_level=True)


@contextlib.contextmanager
def logging_kept():
    """Python's logging as it was before: AReaL's ``getLogger`` swaps in a new
    root logger and manager and re-applies its dictConfig (disabling every
    logger it does not name), which would leave later tests' ``caplog``
    listening to a root nobody logs to."""
    root, manager = logging.root, logging.Logger.manager
    loggers = {name: (lg.disabled, lg.propagate, lg.level) for name, lg in manager.loggerDict.items()
               if isinstance(lg, logging.Logger)}
    try:
        yield
    finally:
        logging.root = logging.Logger.root = root
        logging.Logger.manager = manager
        for name, (disabled, propagate, level) in loggers.items():
            logger = manager.loggerDict[name]
            logger.disabled, logger.propagate, logger.level = disabled, propagate, level


@contextlib.contextmanager
def stand_ins_unless_installed(package: str, *submodules: str):
    """Empty stand-ins for a package a peer imports at module level but that
    cannot install here and that the compared functions never call
    (OpenRLHF's ``flash_attn``, a CUDA build); nothing when it is installed.
    They exist only while the peer imports: afterwards ``sys.modules`` is as
    it was, so nothing else in the process sees them."""
    installed = package in sys.modules or importlib.util.find_spec(package) is not None
    added = [] if installed else [name for name in (package, *submodules) if name not in sys.modules]
    for name in added:
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        module.__path__ = []
        module.__getattr__ = _not_available(name)
        sys.modules[name] = module
    try:
        yield
    finally:
        for name in added:
            sys.modules.pop(name, None)


def _not_available(module: str):
    def attribute(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _unavailable_function(f"{module}.{name}")
    return attribute


def _unavailable_function(qualified: str):
    def call(*args, **kwargs):
        raise RuntimeError(f"{qualified} is a stand-in: the conformance tests never call it")
    return call


@dataclass(frozen=True)
class Batch:
    """[n, L] logprobs of responses in groups of ``group_size`` (prompt-major)."""

    logprobs: torch.Tensor  # the trainer's, differentiated
    proximal: torch.Tensor  # the trainer's at the rollout batch's start (the peers' "old")
    behaviour: torch.Tensor  # the generator's
    ref: torch.Tensor
    mask: torch.Tensor  # 1.0 on real response tokens
    advantages: torch.Tensor  # [n], one per response
    rewards: torch.Tensor  # [n]
    group_size: int

    @property
    def rows(self) -> int:
        return len(self.mask)

    @property
    def groups(self) -> list[list[float]]:
        return self.rewards.view(-1, self.group_size).tolist()

    @property
    def lengths(self) -> list[list[int]]:
        return self.mask.sum(dim=1).long().view(-1, self.group_size).tolist()

    def token_advantages(self, advantages=None) -> torch.Tensor:
        """[n, L]: each response's advantage on its tokens, 0 elsewhere."""
        values = self.advantages if advantages is None else torch.as_tensor(advantages, dtype=torch.float64)
        return values.reshape(-1)[:, None] * self.mask

    def last_token_rewards(self, rewards=None) -> torch.Tensor:
        """[n, L]: each response's reward on its last token (verl's token_level_rewards)."""
        values = self.rewards if rewards is None else rewards
        last = (self.mask.sum(dim=1).long() - 1).clamp(min=0)
        out = torch.zeros_like(self.mask)
        out[torch.arange(self.rows), last] = values * (self.mask.sum(dim=1) > 0)
        return out


def random_batch(seed: int, rows: int = 16, width: int = 12, group_size: int = 4, drift: float = 0.3,
                 mismatch: float = 0.5, empty_rows: int = 0, reward_levels: int = 0, far_ref: float = 25.0) -> Batch:
    """Lengths 1..width (the first ``empty_rows`` rows with none), logprobs in
    (-3, -0.05), the trainer ``drift`` away from the proximal policy (ratios
    that clip), the generator ``mismatch`` away from it (weights past 2),
    a reference with a tenth of its tokens ``far_ref`` off (KL clamps). Rewards: continuous,
    or ``reward_levels`` values 0, 1, ... (ties, constant groups)."""
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    lengths = torch.randint(1, width + 1, (rows,), generator=gen)
    lengths[:empty_rows] = 0
    mask = (torch.arange(width)[None, :] < lengths[:, None]).to(torch.float64)
    logprobs = -0.05 - 2.95 * torch.rand(rows, width, generator=gen, dtype=torch.float64)
    proximal = logprobs + drift * normal(rows, width)
    behaviour = proximal + mismatch * normal(rows, width)
    ref = logprobs + normal(rows, width)
    far = torch.rand(rows, width, generator=gen) < 0.1
    ref = torch.where(far & (far_ref > 0), logprobs + far_ref * torch.sign(normal(rows, width)), ref)
    if reward_levels:
        rewards = torch.randint(0, reward_levels, (rows,), generator=gen).to(torch.float64)
    else:
        rewards = normal(rows)
    return Batch(logprobs * mask, proximal * mask, behaviour * mask, ref * mask, mask, normal(rows), rewards,
                 group_size)


def value_and_grad(loss_of, batch: Batch) -> tuple[float, torch.Tensor]:
    """A loss of the trainer's logprobs, and its gradient on the real tokens."""
    logprobs = batch.logprobs.clone().requires_grad_(True)
    loss = loss_of(logprobs)
    loss.backward()
    return float(loss.detach()), logprobs.grad * batch.mask


def rldsl_loss(batch: Batch, config: PolicyLossConfig, forwards: list[list[int]] | None = None,
               advantages: torch.Tensor | None = None, behaviour: torch.Tensor | None = None):
    """rldsl's loss as its trainers take it: ``policy_loss`` per forward
    (``forwards``: row indices; default one forward), summed, divided by the
    summed ``count_name`` statistic. The proximal logprobs are passed, as a
    trainer's proximal pass does."""
    advantages = batch.advantages if advantages is None else advantages
    behaviour = batch.behaviour if behaviour is None else behaviour

    def loss_of(logprobs):
        parts = [policy_loss(logprobs[rows], behaviour[rows], advantages[rows], batch.mask[rows], config,
                             batch.ref[rows], batch.proximal[rows])
                 for rows in forwards or [list(range(batch.rows))]]
        count = sum(part.stats[config.count_name] for part in parts)
        return sum(part.loss_sum for part in parts) / count

    return loss_of


def assert_same(peer: tuple[float, torch.Tensor], ours: tuple[float, torch.Tensor]) -> None:
    """Loss value and gradient agree within ``TOLERANCE``."""
    assert ours[0] == pytest.approx(peer[0], abs=TOLERANCE), f"loss: peer {peer[0]!r}, rldsl {ours[0]!r}"
    gap = float((ours[1] - peer[1]).abs().max())
    assert gap <= TOLERANCE, f"gradient differs by up to {gap:.3g}"


def difference(peer: tuple[float, torch.Tensor], ours: tuple[float, torch.Tensor]) -> float:
    """The larger of the value's and the gradient's largest gap."""
    return max(abs(ours[0] - peer[0]), float((ours[1] - peer[1]).abs().max()))


def assert_values(peer, ours, mask: torch.Tensor | None = None) -> None:
    """Per-sample (or, with ``mask``, per-token) values agree within ``TOLERANCE``."""
    peer, ours = torch.as_tensor(peer, dtype=torch.float64), torch.as_tensor(ours, dtype=torch.float64)
    if mask is not None:
        peer, ours = peer * mask, ours * mask
    gap = float((peer - ours).abs().max())
    assert gap <= TOLERANCE, f"values differ by up to {gap:.3g}"


def flat(groups: list[list[float]]) -> torch.Tensor:
    return torch.tensor([value for group in groups for value in group], dtype=torch.float64)
