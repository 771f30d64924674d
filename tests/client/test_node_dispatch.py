"""One client dispatch (fedshard.client.node): a train message of width slicing trains the
narrow model, any other the shard of the run's model, with the same replies as the handlers
called directly; the fast path is honoured by HeteroFL's narrow model and refused, naming it,
by ordered dropout, whose step travels in its own argument (TrainConfig.step)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch
from flower_grid import InProcessGrid
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.clientapp import ClientApp
from torch import nn
from torch.utils.data import TensorDataset

from fedshard import LocalTraining, NodePolicy, ReplyPolicy, Sharding, SpectralSharding
from fedshard import protocol as P
from fedshard.app.config import ConfigError, RunConfig
from fedshard.client import handle_query, handle_train, handle_width_train
from fedshard.client.node import handle_node_train, train_kind
from fedshard.client.train import TrainConfig
from fedshard.client.train.fast import FastOptions
from fedshard.client.train.step import EagerStep
from fedshard.client.width import OrderedDropout
from fedshard.server.width import WidthSlicing
from fedshard.settings import Cohort, Slicing
from fedshard.width import WidthFamily


class Net(nn.Module):
    def __init__(self, width: int = 10) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, width), nn.Linear(width, width), nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


FAMILY = WidthFamily(Net, 10)


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(24, 6, generator=g), torch.randint(0, 3, (24,), generator=g))


def _grid() -> InProcessGrid:
    app = ClientApp()

    @app.query()
    def _q(msg: Message, context: Any) -> Message:
        return handle_query(msg, 0.5, "0")

    return InProcessGrid(app, [{}])


def message(method: str) -> Message:
    """A real train message of ``method`` at keep ratio 0.5 (width slicing: width 5 of 10)."""
    training = LocalTraining(lr=0.1, local_epochs=1, batch_size=8, momentum=0.0)
    nodes = NodePolicy(query_timeout=5, node_wait_timeout=5)
    torch.manual_seed(0)
    initial = ArrayRecord(Net().state_dict())
    if method in ("heterofl", "fedrolex", "ordered-dropout"):
        strategy: Any = WidthSlicing(
            family=FAMILY, num_rounds=1, sharding=Sharding(method=method),
            slicing=Slicing(width_match="keep-ratio"), training=training,
            replies=ReplyPolicy(max_update_spread=0.0, max_weight_ratio=0.0), nodes=nodes,
            cohort=Cohort(fraction_evaluate=0.0, min_available_nodes=1, min_train_nodes=1))
    else:
        strategy = SpectralSharding(sharded_layers=["b"], sharding=Sharding(method=method),
                                    training=training, num_rounds=1, seed=3, nodes=nodes,
                                    cohort=Cohort(fraction_evaluate=0.0, min_available_nodes=1,
                                                  min_train_nodes=1))
    return next(iter(strategy.configure_train(1, initial, ConfigRecord(), _grid())))


def arrays(reply: Message) -> dict[str, np.ndarray]:
    assert not reply.has_error(), reply.error.reason
    return {k: a.numpy() for k, a in reply.content[P.ARRAYS].items()}


@pytest.mark.parametrize(("method", "kind"), [("heterofl", "slice"), ("fedrolex", "slice"),
                                              ("ordered-dropout", "slice"),
                                              ("collective", "shard"), ("none", "shard")])
def test_each_method_goes_to_its_handler_with_the_same_reply(method: str, kind: str) -> None:
    msg = message(method)
    assert train_kind(msg) == kind
    direct = (handle_width_train(msg, FAMILY, data()) if kind == "slice"
              else handle_train(msg, Net(), data()))
    built: list[str] = []

    def lazy_model() -> nn.Module:
        built.append("model")
        return Net()

    def lazy_family() -> WidthFamily:
        built.append("family")
        return FAMILY

    routed = handle_node_train(msg, data(), model=lazy_model, family=lazy_family)
    assert built == ["family" if kind == "slice" else "model"]  # only what it needs
    want, got = arrays(direct), arrays(routed)
    assert want.keys() == got.keys()
    for key, value in want.items():
        np.testing.assert_array_equal(got[key], value, err_msg=key)


def test_a_kind_without_its_model_is_refused_naming_what_to_give() -> None:
    with pytest.raises(ValueError, match=r"method is width slicing's \('heterofl'\).*expected "
                                         r"family=\.\.\. \(a WidthFamily\), found none"):
        handle_node_train(message("heterofl"), data(), model=Net())
    with pytest.raises(ValueError, match=r"method is 'collective'.*expected model=\.\.\."):
        handle_node_train(message("collective"), data(), family=FAMILY)


class RecordingFastPath:
    """A fast path that records the models it is asked to train and runs the eager step."""

    def __init__(self) -> None:
        self.models: list[nn.Module] = []

    def enabled(self) -> bool:
        return True

    @contextmanager
    def open_step(self, model: nn.Module, cfg: TrainConfig) -> Iterator[EagerStep]:
        self.models.append(model)
        yield EagerStep(model, cfg)

    def __repr__(self) -> str:
        return "RecordingFastPath()"


def test_heterofls_narrow_model_trains_on_the_fast_path_it_is_given() -> None:
    msg = message("heterofl")
    fast = RecordingFastPath()
    got = arrays(handle_node_train(msg, data(), family=FAMILY, fast=fast))
    assert len(fast.models) == 1  # honoured, not dropped: the narrow model of width 5
    assert fast.models[0].state_dict()["a.weight"].shape == (5, 6)
    want = arrays(handle_width_train(msg, FAMILY, data()))  # the eager step: same numbers
    for key, value in want.items():
        np.testing.assert_array_equal(got[key], value, err_msg=key)


def test_ordered_dropout_refuses_a_fast_path_or_a_step_of_yours_naming_it() -> None:
    msg = message("ordered-dropout")
    with pytest.raises(ValueError, match=r"handle_width_train\(fast=RecordingFastPath\(\)\): "
                                         r"this message asks for ordered dropout"):
        handle_node_train(msg, data(), family=FAMILY, fast=RecordingFastPath())
    mine = OrderedDropout(FAMILY, (5,), seed=0)
    with pytest.raises(ValueError, match=r"handle_width_train\(step=OrderedDropout\(widths=\[5\]"
                                         r", seed=0, distill=False\)\): this message asks"):
        handle_node_train(msg, data(), family=FAMILY, step=mine)
    # the fast options all off ask for nothing: ordered dropout trains
    off = arrays(handle_node_train(msg, data(), family=FAMILY, fast=FastOptions()))
    plain = arrays(handle_node_train(msg, data(), family=FAMILY))
    for key, value in plain.items():
        np.testing.assert_array_equal(off[key], value, err_msg=key)


def test_a_step_and_an_enabled_fast_path_are_refused_together() -> None:
    od = OrderedDropout(FAMILY, (5, 10), seed=0)
    with pytest.raises(ValueError, match=r"TrainConfig\(step=OrderedDropout\(widths=\[5, 10\], "
                                         r"seed=0, distill=False\), fast=FastOptions\(.*\)\): "
                                         r"expected one of them"):
        TrainConfig(step=od, fast=FastOptions(reuse_step=True))
    TrainConfig(step=od, fast=FastOptions())  # every option off: the step alone
    with pytest.raises(ValueError, match=r"TrainConfig\.step=3: expected a function"):
        TrainConfig(step=3)  # type: ignore[arg-type]


def test_a_run_config_with_ordered_dropout_and_the_fast_path_is_refused_before_round_1() -> None:
    base = {"model": "mlp", "model-width": 16, "method": "ordered-dropout"}
    with pytest.raises(ConfigError, match=r"compile=true and merge-terms=true with "
                                          r"method='ordered-dropout': ordered dropout trains "
                                          r"with its own step"):
        RunConfig.from_mapping({**base, "compile": True, "merge-terms": True})
    RunConfig.from_mapping(base)  # off: fine
    RunConfig.from_mapping({**base, "method": "heterofl", "compile": True})  # honoured there
