"""The fsdp engines: torch FSDP2 (``fully_shard``) on CPU (gloo) or GPUs.

- ``FsdpTrainer`` (the split-step trainer over sharded parameters, trainer.py)
- ``FsdpLogprob``  (policy or frozen reference log-probabilities, logprob.py)

Both hold the same ``rldsl.models.base.CausalLM`` as the torch engines.
"""

from rldsl.runtime.engines.fsdp.logprob import FsdpLogprob
from rldsl.runtime.engines.fsdp.trainer import FsdpTrainer

__all__ = ["FsdpLogprob", "FsdpTrainer"]
