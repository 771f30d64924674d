"""fedshard ServerApp: spectral model sharding on the run's model and data set (thin)."""

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedshard.app.config import RunConfig
from fedshard.app.run import run_server

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = RunConfig.from_mapping(context.run_config)  # every problem reported before round 1
    run_server(grid, cfg)
