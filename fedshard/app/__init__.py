"""fedshard's own Flower app (``flwr run .``): the run config, the task (model and data of a
node), the ServerApp's run with its checkpoints and result files.

The library (:mod:`fedshard.client`, :mod:`fedshard.server` and below) never imports this
package; the root ``client_app.py`` and ``server_app.py`` are thin wrappers around it.

- :mod:`~fedshard.app.config` - :class:`RunConfig`: every run-config key, validated once.
- :mod:`~fedshard.app.task` - a node's model, data partition, device and keep ratio.
- :mod:`~fedshard.app.run` - :func:`run_server`, the ServerApp's whole job.
- :mod:`~fedshard.app.callbacks` - the app's side jobs as the strategy's callbacks (the
  metrics file, the checkpoint, central evaluation on the run's test set), composed by
  :func:`run_server` after the library's own (:mod:`fedshard.server.callbacks`).
- :mod:`~fedshard.app.checkpoint`, :mod:`~fedshard.app.results`, :mod:`~fedshard.app.rundir` -
  resumable checkpoints, result files, the run directory and its lock.
- :mod:`~fedshard.app.savings` - what sharding bought, at the end of a run (bytes, FLOPs,
  accuracy against an r = 1 run).
"""

from fedshard.app.config import ConfigError, RunConfig
from fedshard.app.run import run_server

__all__ = ["ConfigError", "RunConfig", "run_server"]
