"""fedshard: spectral model sharding for federated learning.

Layout (data flows one way: sampling → spectral → training → protocol/strategy → apps):

- :mod:`fedshard.sampling` - inclusion probabilities, multipliers, sampling designs, the
  annealed methods (``sampling.anneal``), the round's plan and the random streams (numpy only).
- :mod:`fedshard.spectral` - SVD, factorized layers, model surgery, per-term aggregation, rank
  truncation (``spectral.truncation``: the low-rank start and the Top-n diagnostics).
- :mod:`fedshard.optim`, :mod:`fedshard.batches` - ClipLR and Frobenius decay; batches.
- :mod:`fedshard.training` - the client's local training step (eager, compiled, CUDA graph).
- :mod:`fedshard.protocol` - the wire codec: record keys, train settings, shards, reply checks
  and bounds.
- :mod:`fedshard.nodes` - waiting for nodes, their capabilities, seeded node sampling.
- :mod:`fedshard.rounds` - one training round on the server (shard, check, aggregate).
- :mod:`fedshard.reference` - the paper's post-gradient analysis (``fedavg-cosine``).
- :mod:`fedshard.strategy` - the Flower strategy ``SpectralSharding`` (thin hooks).
- :mod:`fedshard.client`, :mod:`fedshard.shard`, :mod:`fedshard.clientapp` - the client's
  handlers, the received shard for your own loop, Flower glue.
- :mod:`fedshard.privacy` - Flower's DP wrappers refused (they assume dense replies).
- :mod:`fedshard.checkpoint`, :mod:`fedshard.results`, :mod:`fedshard.rundir` - run state.
- :mod:`fedshard.schedule`, :mod:`fedshard.telemetry` - lr schedules, per-round metrics.
- :mod:`fedshard.models`, :mod:`fedshard.data` - the paper's models and data sets.
- :mod:`fedshard.config` (with :mod:`fedshard.mixture`), :mod:`fedshard.task`,
  :mod:`fedshard.experiment` - the apps' run config, client side and server side (the library
  never imports them).

From the paper to the code:

======================================  ==================================================
Paper                                   Code
======================================  ==================================================
SVD, √λ absorbed (Sec. 3.1 step 1)      ``spectral.decompose.decompose``, ``layer_spectrum``
n = ⌈rN⌉                                ``sampling.plan.num_terms``
Theorem 1 (Unbiased, ω = 1/π)           ``sampling.probabilities._unbiased_sorted``
Theorem 2 (Collective, ω=C/(1+π(C−1)))  ``sampling.probabilities._collective_sorted``
PriSM, Wallenius mean, +Scaled          ``sampling.probabilities``, ``sampling.wallenius``
Conditional Poisson sampling (CPS)      ``sampling.cps.ConditionalPoisson``
Method → design, per group and layer    ``sampling.plan.draw_layer``, ``plan_round``
ANME                                    ``sampling.entropy.anme``
Factorized layer U·diag(ω)·Vᵀ           ``spectral.layers.SpectralLinear``, ``spectral.conv``
Frobenius decay γ‖UΩVᵀ‖²_F (Sec. 3.3)   ``optim.frobenius_penalty``, ``optim.FrobeniusDecay``
ClipLR min(1, τ/ω_i) (Sec. 3.3)         ``optim.ClipLR.column_scale``
Per-term aggregation (Sec. 3.1 step 3)  ``spectral.aggregate.term_means``, ``rebuild_weight``
Cosine lr over rounds (Sec. 4.1)        ``schedule.cosine_lr``
Post-client updates vs FedAvg (4.4)     ``reference.fedavg_cosines``
(beyond) Theorem 1/2 on λ^γ, annealed   ``sampling.anneal.annealed_probabilities``
(beyond) low-rank start, truncation     ``spectral.truncation.truncate_``
======================================  ==================================================
"""

__version__ = "0.1.0"
