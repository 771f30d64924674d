"""advanced_pytorch: A Flower / PyTorch app (the custom strategy)."""

import json
import time
from collections.abc import Callable, Iterable
from logging import INFO
from pathlib import Path

import torch
from fedshard import SpectralSharding
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from flwr.serverapp.strategy.strategy_utils import log_strategy_start_info

from advanced_pytorch.task import Net


class CustomFedAvg(SpectralSharding):
    """FedAvg that halves the learning rate at round 5 and, in its own `start()`, saves
    the best global model and every round's metrics (`results.json`) to `save_path`."""

    save_path = Path("outputs")
    lr_decay_round = 5

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Configure the next round of training; halve the learning rate at round 5."""
        if server_round == self.lr_decay_round:
            config["lr"] = config["lr"] * 0.5
            log(INFO, "Learning rate halved to %g", config["lr"])
        return super().configure_train(server_round, arrays, config, grid)

    def save_best(self, server_round: int, accuracy: float, arrays: ArrayRecord) -> None:
        """Save the global model when its accuracy is the best so far."""
        if accuracy > self.best_accuracy:
            self.best_accuracy = accuracy
            model = Net()
            model.load_state_dict(arrays.to_torch_state_dict())
            torch.save(model.state_dict(), self.save_path / "best_model.pt")
            log(INFO, "New best global model: round %d, accuracy %.4f", server_round, accuracy)

    def save_results(self, result: Result) -> None:
        """Write every round's metrics so far to `results.json`."""
        rounds = sorted({0, *result.train_metrics_clientapp, *result.evaluate_metrics_serverapp})
        results = [
            {
                "round": r,
                "train_metrics": dict(result.train_metrics_clientapp.get(r, {})),
                "evaluate_metrics_clientapp": dict(result.evaluate_metrics_clientapp.get(r, {})),
                "evaluate_metrics_serverapp": dict(result.evaluate_metrics_serverapp.get(r, {})),
            }
            for r in rounds
        ]
        (self.save_path / "results.json").write_text(json.dumps(results, indent=2))

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Run the rounds as FedAvg does, saving the best model and the results."""
        log(INFO, "Starting %s strategy:", self.__class__.__name__)
        log_strategy_start_info(num_rounds, initial_arrays, train_config, evaluate_config)
        self.summary()
        train_config = ConfigRecord() if train_config is None else train_config
        evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
        self.best_accuracy = 0.0
        result = Result()
        arrays = initial_arrays
        t_start = time.time()
        if evaluate_fn and (res := evaluate_fn(0, arrays)) is not None:
            result.evaluate_metrics_serverapp[0] = res

        for server_round in range(1, num_rounds + 1):
            log(INFO, "")
            log(INFO, "[ROUND %s/%s]", server_round, num_rounds)

            # Training on the nodes
            replies = grid.send_and_receive(
                self.configure_train(server_round, arrays, train_config, grid), timeout=timeout
            )
            new_arrays, train_metrics = self.aggregate_train(server_round, replies)
            if new_arrays is not None:
                arrays = result.arrays = new_arrays
            if train_metrics is not None:
                log(INFO, "\t└──> Aggregated MetricRecord: %s", train_metrics)
                result.train_metrics_clientapp[server_round] = train_metrics

            # Evaluation on the nodes (each with its own classification head)
            replies = grid.send_and_receive(
                self.configure_evaluate(server_round, arrays, evaluate_config, grid),
                timeout=timeout,
            )
            eval_metrics = self.aggregate_evaluate(server_round, replies)
            if eval_metrics is not None:
                log(INFO, "\t└──> Aggregated MetricRecord: %s", eval_metrics)
                result.evaluate_metrics_clientapp[server_round] = eval_metrics

            # Evaluation of the global model on the server
            if evaluate_fn and (res := evaluate_fn(server_round, arrays)) is not None:
                log(INFO, "\t└──> Global evaluation: %s", res)
                result.evaluate_metrics_serverapp[server_round] = res
                self.save_best(server_round, res["accuracy"], arrays)

            self.save_results(result)

        log(INFO, "")
        log(INFO, "Strategy execution finished in %.2fs", time.time() - t_start)
        return result
