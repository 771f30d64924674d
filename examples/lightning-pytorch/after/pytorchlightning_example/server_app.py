"""pytorchlightning_example: A Flower / PyTorch Lightning app."""

import torch
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from fedshard import SpectralSharding

from pytorchlightning_example.task import LitAutoEncoder

# Create ServerApp
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Main entry point for the ServerApp."""

    # Read run config
    num_rounds: int = context.run_config["num-server-rounds"]
    fraction_train: float = context.run_config["fraction-train"]
    fraction_evaluate: float = context.run_config["fraction-evaluate"]

    # Load global model
    global_model = LitAutoEncoder()
    arrays = ArrayRecord(global_model.state_dict())

    # Initialize the strategy
    strategy = SpectralSharding.from_model(
        global_model, sharded_layers=["encoder.0", "decoder.2"],  # the 784x64 and 64x784 layers
        method="unbiased", lr=1e-3, lr_schedule="constant", clip_lr_tau=2.0,  # Adam's lr
        fraction_train=fraction_train, fraction_evaluate=fraction_evaluate)

    # Start strategy, run for `num_rounds`
    result = strategy.start(grid=grid, initial_arrays=arrays, num_rounds=num_rounds)

    # Save final model to disk
    print("\nSaving final model to disk...")
    state_dict = result.arrays.to_torch_state_dict()
    torch.save(state_dict, "final_model.pt")
