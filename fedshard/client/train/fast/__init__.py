"""The fast path of local training, fenced off from the plain loop: a whole training step
compiled (``torch.compile``) or captured as CUDA graphs, thin convolutions padded or merged,
and a per-process pool of steps reused across clients of the same shapes.

Everything here is opt-in through :class:`~fedshard.client.train.TrainConfig`
(``compile``, ``cuda_graph``, ``pad_terms``, ``reuse_step``, ``merge_terms``) and reaches the
loop only through :func:`enabled` and :func:`open_step`; the eager step
(:class:`~fedshard.client.train.step.EagerStep`) gives the same numbers up to float rounding.
Where each option wins, measured: ``benchmarks/README.md``.
"""

from fedshard.client.train.fast.plug import STEP_POOL, enabled, open_step
from fedshard.client.train.fast.pool import StepPool, model_signature
from fedshard.client.train.fast.step import TrainStep, configure_convolutions, conv_options

__all__ = [
    "STEP_POOL",
    "StepPool",
    "TrainStep",
    "configure_convolutions",
    "conv_options",
    "enabled",
    "model_signature",
    "open_step",
]
