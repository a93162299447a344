"""The policy loss's settings (``grpo(...)`` in a pipeline file) and their checks.

``policy_loss.py`` computes the loss from them; ``loss_terms.py`` holds its
pieces. The names are the language's (rldsl/compiler/schema.py LOSSES).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Sums over the optimizer step divided by a global count: any split into microbatches gives the same gradient.
AGGREGATIONS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean")
# Each forward's own token mean, averaged over the step's forwards (verl's legacy FSDP worker, TRL's bnpo):
# the gradient depends on which rows share a forward.
PER_FORWARD_AGGREGATIONS = ("micro_token_mean",)
KL_ESTIMATORS = ("k1", "k2", "k3")
KL_PLACEMENTS = ("loss", "reward")
RATIO_LEVELS = ("token", "sequence")
CORRECTIONS = ("none", "is", "tis", "mis", "icepop")
CORRECTION_LEVELS = ("token", "sequence")
# (low, high) bounds of the weight when left out: verl's and slime's 2.0; IcePop's two-sided [0.5, 5];
# ``is`` has none (NeMo RL's importance sampling correction with no truncation ratio).
DEFAULT_CORRECTION_BOUNDS = {"is": (0.0, math.inf), "tis": (0.0, 2.0), "mis": (0.0, 2.0), "icepop": (0.5, 5.0)}
# Corrections that can reject a token (weight 0): ``is`` drops a weight that overflowed.
REJECTING_CORRECTIONS = ("is", "mis", "icepop")
# What a rejected token keeps: ``drop``: nothing but its place in the mean's count; ``zero``: its KL term and
# its count (only the policy term weighs 0: TRL, OpenRLHF, verl's IcePop); ``unmask``: nothing (verl's
# rejection sampling takes it out of the response mask).
REJECTED = ("drop", "zero", "unmask")


@dataclass(frozen=True)
class PolicyLossConfig:
    clip: float = 0.2  # low side: the ratio is kept >= 1 - clip
    clip_high: float | None = None  # high side: <= 1 + clip_high; None: clip (DAPO sets it higher)
    dual_clip: float = 0.0  # 0: off; c > 1 caps a negative advantage's token loss at -A * c
    kl: float = 0.0  # coefficient of the KL to the reference
    kl_estimator: str = "k3"  # k1: d, k2: d^2 / 2, k3: e^-d + d - 1, with d = logp - ref
    kl_in: str = "loss"  # "loss": a differentiable term; "reward": a per-token reward penalty
    agg: str = "token_mean"
    ratio: str = "token"  # "sequence": GSPO's length-normalised sequence ratio
    behaviour_cap: float = 0.0  # 0: off; else the decoupled objective, weights above the cap masked
    kl_input_clamp: float = 0.0  # 0: off; else d = logp - ref is clamped to [-c, c] before the estimator
    kl_output_clamp: float = 0.0  # 0: off; else each token's KL estimate is clamped to [-c, c]
    correction: str = "none"  # is: weight as is; tis: clamped to [low, high]; mis / icepop: 0 outside [low, high]
    correction_level: str = "token"  # "sequence": w is the product of the response's token weights
    correction_low: float | None = None  # None: DEFAULT_CORRECTION_BOUNDS
    correction_high: float | None = None
    length_norm: float = 0.0  # 0: off; else seq_mean_token_sum is also divided by it (Dr. GRPO's constant)
    count_masked: bool = False  # seq_mean_*: a sequence with no trained token still counts (TRL)
    rejected: str = "drop"  # REJECTED: what a token a correction or behaviour_cap rejects keeps
    rejected_in_ratio: bool = True  # False: GSPO's sequence ratio averages the kept tokens only (AReaL)
    kl_weighted: bool = False  # the loss's KL term times the policy ratio: the unbiased reverse-KL gradient (TRL)

    def __post_init__(self):
        _check_choice("agg", self.agg, AGGREGATIONS + PER_FORWARD_AGGREGATIONS)
        _check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _check_choice("kl_in", self.kl_in, KL_PLACEMENTS)
        _check_choice("ratio", self.ratio, RATIO_LEVELS)
        _check_choice("correction", self.correction, CORRECTIONS)
        _check_choice("correction_level", self.correction_level, CORRECTION_LEVELS)
        _check_choice("rejected", self.rejected, REJECTED)
        self._check_correction()
        if not 0 <= self.clip < 1:
            raise ValueError(f"clip {self.clip} must be in [0, 1)")
        if self.clip_high is not None and self.clip_high < 0:
            raise ValueError(f"clip_high {self.clip_high} must be >= 0")
        if self.dual_clip != 0 and self.dual_clip <= 1:
            raise ValueError(f"dual_clip {self.dual_clip} must be 0 (off) or > 1")
        if self.kl < 0:
            raise ValueError(f"kl coefficient {self.kl} must be >= 0")
        if self.behaviour_cap != 0 and self.behaviour_cap < 1:
            raise ValueError(f"behaviour_cap {self.behaviour_cap} must be 0 (off) or >= 1")
        if self.kl_input_clamp < 0 or self.kl_output_clamp < 0:
            raise ValueError(f"kl_input_clamp {self.kl_input_clamp} and kl_output_clamp {self.kl_output_clamp} "
                             "must be >= 0 (0: off)")
        if self.length_norm < 0 or (self.length_norm and self.agg != "seq_mean_token_sum"):
            raise ValueError(f"length_norm {self.length_norm} divides agg 'seq_mean_token_sum' only (0: off)")
        if self.count_masked and not self.agg.startswith("seq_mean"):
            raise ValueError(f"count_masked counts sequences: agg {self.agg!r} counts tokens")
        if self.kl_weighted and self.kl_in != "loss":
            raise ValueError("kl_weighted weights the loss's KL term: kl_in must be 'loss'")

    def _check_correction(self) -> None:
        if self.correction == "none":
            return
        if self.behaviour_cap:
            raise ValueError(f"behaviour_cap and correction {self.correction!r} both weight the tokens: use one")
        if self.correction == "is" and (self.correction_low, self.correction_high) != (None, None):
            raise ValueError("correction 'is' leaves the weight untruncated: correction_low and correction_high "
                             "bound tis, mis and icepop only")
        if self.correction == "icepop" and self.correction_level != "token":
            raise ValueError("correction 'icepop' masks tokens: correction_level must be 'token' (or use 'mis')")
        low, high = self.correction_bounds
        if not 0 <= low <= 1 <= high:
            raise ValueError(f"correction bounds [{low}, {high}] must satisfy 0 <= correction_low <= 1 <= "
                             "correction_high (an on-policy token, weight 1, is always kept whole)")

    @property
    def correction_bounds(self) -> tuple[float, float]:
        """(low, high) of the importance weight; behaviour_cap is a token mask at (0, cap)."""
        if self.behaviour_cap:
            return 0.0, self.behaviour_cap
        low, high = DEFAULT_CORRECTION_BOUNDS.get(self.correction, (0.0, 0.0))
        return (low if self.correction_low is None else self.correction_low,
                high if self.correction_high is None else self.correction_high)

    @property
    def needs_proximal(self) -> bool:
        """The loss is taken against the batch-start (proximal) policy: exact
        over several optimizer steps only with a proximal pass."""
        return bool(self.behaviour_cap) or self.correction != "none"

    @property
    def rejects_tokens(self) -> bool:
        """A token may get weight 0 (behaviour_cap, or a masking correction)."""
        return bool(self.behaviour_cap) or self.correction in REJECTING_CORRECTIONS

    @property
    def kl_clamps(self) -> dict[str, float]:
        return {"input_clamp": self.kl_input_clamp, "output_clamp": self.kl_output_clamp}

    @property
    def upper_clip(self) -> float:
        return self.clip if self.clip_high is None else self.clip_high

    @property
    def count_name(self) -> str:
        """The statistic the loss sum is divided by: ``tokens`` or ``sequences``
        read off the masks, or ``loss_count``, the loss's own count, where it is
        neither (a mean per forward, masked rows counted, rejected tokens left
        out of the mask)."""
        if self.agg in PER_FORWARD_AGGREGATIONS or self.count_masked or \
                (self.rejects_tokens and self.rejected == "unmask"):
            return "loss_count"
        return "tokens" if self.agg == "token_mean" else "sequences"


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"loss {name} {value!r}: expected one of {', '.join(choices)}")
