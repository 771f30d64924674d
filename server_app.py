"""fedshard ServerApp: spectral model sharding on the run's model and data set (thin)."""

from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp

from fedshard.config import RunConfig
from fedshard.experiment import build_model, build_strategy, central_evaluate_fn
from fedshard.results import RunRecorder

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = RunConfig.from_mapping(context.run_config)  # every problem reported before round 1
    model = build_model(cfg)
    strategy = build_strategy(cfg, model)
    recorder = RunRecorder(cfg.results_path, cfg.as_dict(), cfg.num_server_rounds)
    initial = ArrayRecord(model.state_dict())
    result = strategy.start(
        grid=grid,
        initial_arrays=initial,
        num_rounds=cfg.num_server_rounds,
        timeout=cfg.round_timeout,
        train_config=ConfigRecord(),
        evaluate_fn=central_evaluate_fn(cfg, model, strategy, recorder),
    )
    # Flower's Result holds no arrays when no round produced an update: the model is unchanged.
    final = result.arrays if len(result.arrays) > 0 else initial
    recorder.finish(final.to_torch_state_dict())
