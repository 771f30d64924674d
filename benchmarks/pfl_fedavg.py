"""pfl-research's FedAvg simulation against a bare torch loop: the ``pfl`` side of
``bench_engine.py --pfl-python``.

Run by ``bench_engine.py`` with another interpreter (one where ``pfl[pytorch]`` is installed,
e.g. ``../venv-pfl/bin/python`` after ``python3 -m venv ../venv-pfl && ../venv-pfl/bin/pip
install "pfl[pytorch]"``); it imports neither fedshard nor flwr. Its input is one
``torch.save`` file that ``bench_engine.py`` writes (:func:`write_input`'s keys): the model
(a ``torch.nn.Sequential`` of torch's own modules, fedshard's MLP's ``net``), every client's
examples as tensors, the test examples, and the recipe (lr, momentum, weight decay, batch,
epochs, rounds, threads, seed). It runs pfl's public API as pfl's own PyTorch examples do:
:class:`pfl.model.pytorch.PyTorchModel` with SGD-m as the local optimizer and SGD (lr 1) as
the central one, a :class:`pfl.data.federated_dataset.FederatedDataset` of the clients,
:class:`pfl.aggregate.simulate.SimulatedBackend`, :class:`pfl.algorithm.FederatedAveraging`,
the test set evaluated every round by
:class:`pfl.callback.central_evaluation.CentralEvaluationCallback` (pfl's evaluation of each
client's data before and after its training only in the first round, which the ratio leaves
out: the engine and the bare loop do not evaluate their clients).

Each round, right after pfl's round ends (its central evaluation included), one round of the
bare loop runs (timed apart and taken out of the next pfl round's time), as
``bench_engine.py`` pairs its engine's rounds: the ratio of each pfl round to the bare round
next to it, over the rounds after the first. Prints one JSON object.

Usage: ``PYTHON benchmarks/pfl_fedavg.py INPUT.pt``.
"""

from __future__ import annotations

import copy
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class _Classifier(nn.Module):
    """The benchmark's network with the ``loss`` and ``metrics`` that pfl's
    :class:`~pfl.model.pytorch.PyTorchModel` asks of a module."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # (B, classes)

    def loss(self, x: torch.Tensor, y: torch.Tensor, eval: bool = False) -> torch.Tensor:
        self.eval() if eval else self.train()
        return F.cross_entropy(self(x), y)

    @torch.no_grad()
    def metrics(self, x: torch.Tensor, y: torch.Tensor, eval: bool = True) -> dict[str, Any]:
        from pfl.metrics import Weighted

        self.eval() if eval else self.train()
        logits = self(x)
        n = len(y)
        return {"loss": Weighted(F.cross_entropy(logits, y, reduction="sum").item(), n),
                "accuracy": Weighted(int((logits.argmax(-1) == y).sum()), n)}


class _Bare:
    """Dense FedAvg in a plain loop (``bench_engine.BareLoop``'s steps, without fedshard)."""

    def __init__(self, net: nn.Module, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.model = copy.deepcopy(net)
        self.work = copy.deepcopy(net)

    def round(self, server_round: int) -> float:
        s = self.spec
        t0 = time.perf_counter()
        total = {k: torch.zeros_like(v) for k, v in self.model.state_dict().items()}
        weight = 0
        for pid, (x, y) in enumerate(s["clients"]):
            self.work.load_state_dict(self.model.state_dict())
            opt = torch.optim.SGD(self.work.parameters(), lr=s["lr"], momentum=s["momentum"],
                                  weight_decay=s["weight_decay"])
            gen = torch.Generator().manual_seed(s["seed"] * 1_000_003 + server_round * 1009 + pid)
            for _ in range(s["epochs"]):
                order = torch.randperm(len(x), generator=gen)
                for start in range(0, len(x), s["batch"]):
                    idx = order[start:start + s["batch"]]
                    opt.zero_grad(set_to_none=True)
                    F.cross_entropy(self.work(x[idx]), y[idx]).backward()
                    opt.step()
            for k, v in self.work.state_dict().items():
                total[k] += len(x) * v
            weight += len(x)
        self.model.load_state_dict({k: v / weight for k, v in total.items()})
        self.model.eval()
        with torch.no_grad():
            tx, ty = s["test"]
            correct = sum(int((self.model(tx[i:i + 256]).argmax(-1) == ty[i:i + 256]).sum())
                          for i in range(0, len(tx), 256))
        self.model.train()
        assert 0 <= correct <= len(tx)
        return time.perf_counter() - t0


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """pfl's FedAvg for ``spec["rounds"]`` rounds, each paired with a bare round."""
    import pfl
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.callback.central_evaluation import CentralEvaluationCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import get_user_sampler
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Metrics
    from pfl.model.pytorch import PyTorchModel

    torch.set_num_threads(spec["threads"])
    net: nn.Module = spec["net"]
    bare = _Bare(net, spec)
    module = _Classifier(copy.deepcopy(net))
    model = PyTorchModel(
        model=module,
        local_optimizer_create=functools.partial(torch.optim.SGD, momentum=spec["momentum"],
                                                 weight_decay=spec["weight_decay"]),
        central_optimizer=torch.optim.SGD(module.parameters(), lr=1.0))
    clients = spec["clients"]
    users = FederatedDataset(
        lambda uid: Dataset(raw_data=[clients[uid][0], clients[uid][1]], user_id=uid),
        get_user_sampler("minimize_reuse", list(range(len(clients)))))
    tx, ty = spec["test"]
    ends: list[float] = []
    bare_s: list[float] = []

    class PairedTimer(TrainingProcessCallback):  # type: ignore[misc]
        """The end of each pfl round, then one bare round (timed apart)."""

        def on_train_begin(self, *, model: Any) -> Any:
            ends.append(time.perf_counter())
            return Metrics()

        def after_central_iteration(self, aggregate_metrics: Any, model: Any, *,
                                    central_iteration: int) -> tuple[bool, Any]:
            ends.append(time.perf_counter())
            bare_s.append(bare.round(central_iteration + 1))
            ends[-1] += bare_s[-1]  # the next pfl round starts after the bare one
            return False, Metrics()

    rounds = spec["rounds"]
    FederatedAveraging().run(
        # pfl's own evaluation of every client's data before and after its local training
        # (``do_evaluation``) only in round 1, the warm-up left out of the ratio: neither
        # the engine nor the bare loop evaluates its clients; the test set is evaluated every
        # round by the callback, as theirs is
        algorithm_params=NNAlgorithmParams(central_num_iterations=rounds,
                                           evaluation_frequency=rounds,
                                           train_cohort_size=len(clients),
                                           val_cohort_size=0),
        backend=SimulatedBackend(training_data=users, val_data=users),
        model=model,
        model_train_params=NNTrainHyperParams(local_learning_rate=spec["lr"],
                                              local_num_epochs=spec["epochs"],
                                              local_batch_size=spec["batch"]),
        model_eval_params=NNEvalHyperParams(local_batch_size=256),
        callbacks=[CentralEvaluationCallback(Dataset(raw_data=[tx, ty]),
                                             NNEvalHyperParams(local_batch_size=256),
                                             frequency=1),
                   PairedTimer()])
    if len(ends) != rounds + 1:
        raise SystemExit(f"pfl_fedavg: pfl ran {len(ends) - 1} rounds, expected {rounds}")
    pfl_s = [ends[i + 1] - ends[i] - bare_s[i] for i in range(rounds)]
    # the bare round before pfl's round i + 1 is bare_s[i - 1]; rounds after the first
    ratios = [pfl_s[i] / bare_s[i - 1] for i in range(1, rounds)]
    return {"pfl": pfl.__version__, "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "s_per_round": {"bare": round(statistics.median(bare_s[:-1]), 4),
                            "pfl": round(statistics.median(pfl_s[1:]), 4)},
            "pfl_vs_bare_rounds": [round(r, 4) for r in ratios]}


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: pfl_fedavg.py INPUT.pt (written by bench_engine.py)")
    spec = torch.load(Path(sys.argv[1]), weights_only=False)
    print(json.dumps(run(spec)))


if __name__ == "__main__":
    main()
