"""fedshard: spectral model sharding for federated learning.

Layout (data flows one way):

- :mod:`fedshard.sampling` - inclusion probabilities, auxiliary multipliers and sampling
  designs (numpy only).
- :mod:`fedshard.spectral` - SVD decomposition, factorized layers, model surgery (torch only).
- :mod:`fedshard.training` - the client's local training (SGD, Frobenius decay, ClipLR).
- :mod:`fedshard.models`, :mod:`fedshard.data` - the paper's models and data sets.
- :mod:`fedshard.strategy` - the Flower strategy ``SpectralSharding``.
"""

__version__ = "0.1.0"
