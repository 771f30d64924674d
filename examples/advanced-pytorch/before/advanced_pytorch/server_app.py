"""advanced_pytorch: A Flower / PyTorch app."""

import json
from datetime import datetime
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from advanced_pytorch.strategy import CustomFedAvg
from advanced_pytorch.task import Net, load_centralized_dataset, test

# Create ServerApp
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Main entry point for the ServerApp."""

    # Read run config
    fraction_train: float = context.run_config["fraction-train"]
    fraction_evaluate: float = context.run_config["fraction-evaluate"]
    num_rounds: int = context.run_config["num-server-rounds"]
    lr: float = context.run_config["lr"]

    # This run's output folder: outputs/<date>/<time>, with the run config
    save_path = Path.cwd() / "outputs" / datetime.now().strftime("%Y-%m-%d/%H-%M-%S")
    save_path.mkdir(parents=True)
    (save_path / "run_config.json").write_text(json.dumps(dict(context.run_config)))

    # Load global model
    global_model = Net()
    arrays = ArrayRecord(global_model.state_dict())

    # Initialize the strategy
    strategy = CustomFedAvg(
        fraction_train=fraction_train, fraction_evaluate=fraction_evaluate
    )
    strategy.save_path = save_path

    # Start strategy, run for `num_rounds`
    result = strategy.start(
        grid=grid,
        initial_arrays=arrays,
        train_config=ConfigRecord({"lr": lr}),
        num_rounds=num_rounds,
        evaluate_fn=global_evaluate,
    )

    # Save final model to disk
    print(f"\nSaving final model to {save_path}...")
    torch.save(result.arrays.to_torch_state_dict(), save_path / "final_model.pt")


def global_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    """Evaluate the global model on the test split."""
    model = Net()
    model.load_state_dict(arrays.to_torch_state_dict())
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    loss, accuracy = test(model, load_centralized_dataset(), device)
    return MetricRecord({"accuracy": accuracy, "loss": loss})
