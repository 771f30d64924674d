"""The fast path of local training, fenced off from the plain loop: a whole training step
compiled (``torch.compile``) or captured as CUDA graphs, thin convolutions padded or merged,
and a per-process pool of steps reused across clients of the same shapes.

Everything here is opt-in through one object, :class:`FastOptions`, given to
:class:`~fedshard.client.train.TrainConfig` (``fast=``) or to
:func:`~fedshard.client.handle_train`; the loop reaches it only through the object's
:meth:`~FastOptions.enabled` and :meth:`~FastOptions.open_step`, and the eager step
(:class:`~fedshard.client.train.step.EagerStep`) gives the same numbers up to float rounding.
Where each option wins, and the scripts that measure it: ``benchmarks/README.md``.
"""

from fedshard.client.train.fast.convolutions import configure_convolutions, conv_form
from fedshard.client.train.fast.options import FastOptions
from fedshard.client.train.fast.plug import STEP_POOL
from fedshard.client.train.fast.pool import StepPool, model_signature
from fedshard.client.train.fast.step import TrainStep, conv_options

__all__ = [
    "STEP_POOL",
    "FastOptions",
    "StepPool",
    "TrainStep",
    "configure_convolutions",
    "conv_form",
    "conv_options",
    "model_signature",
]
