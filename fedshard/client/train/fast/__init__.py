"""The fast path of local training, fenced off from the plain loop: a whole training step
compiled (``torch.compile``) or captured as CUDA graphs, thin convolutions padded, and a
per-process pool of steps reused across clients of the same shapes.

Everything here is opt-in through :class:`~fedshard.client.train.TrainConfig`
(``compile``, ``cuda_graph``, ``pad_terms``, ``reuse_step``, ``merge_terms``); the eager step
gives the same numbers up to float rounding.
"""

from fedshard.client.train.fast.pool import StepPool, model_signature
from fedshard.client.train.fast.step import TrainStep

__all__ = ["StepPool", "TrainStep", "model_signature"]
