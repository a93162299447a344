"""The torch engines: the embedded default on CPU (and usable on one GPU).

- ``TorchGenerator`` (generation, generate.py)
- ``TorchLogprob``   (policy or frozen reference log-probabilities, logprob.py)
- ``TorchTrainer``   (the split-step trainer, train.py)

All three hold a ``rldsl.models.base.CausalLM`` from ``rldsl.models.load_model``
(the builtin model warm-started by warmstart.py).
"""

from rldsl.runtime.engines.torch.generate import TorchGenerator
from rldsl.runtime.engines.torch.logprob import TorchLogprob
from rldsl.runtime.engines.torch.train import TorchTrainer

__all__ = ["TorchGenerator", "TorchLogprob", "TorchTrainer"]
