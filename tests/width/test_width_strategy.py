"""WidthSlicing and its node side in process, with real Messages: what each node is sent,
what the server makes of the replies (against a brute-force re-computation from the
messages), ordered dropout's step and HeteroFL's scaler, and the errors."""

from __future__ import annotations

import copy
import logging
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flower_grid import InProcessGrid
from flwr.app import ArrayRecord, Message
from flwr.clientapp import ClientApp
from torch import nn
from torch.utils.data import TensorDataset

from fedshard import (
    Cohort,
    LocalTraining,
    NodePolicy,
    ReplyPolicy,
    SettingsError,
    Sharding,
    Slicing,
    SpectralSharding,
    WidthFamily,
    WidthSlicing,
    handle_query,
)
from fedshard import protocol as P
from fedshard.client.train import TrainConfig, train
from fedshard.client.width import OrderedDropout, Scaler, attach_scaler, handle_width_train
from fedshard.protocol.slices import SLICE_ORDER_KEYS, SliceOrder
from fedshard.server.width import od_widths


class Net(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, width), nn.Linear(width, width), nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


FAMILY = WidthFamily(Net, 10)


def _data(node: int, n: int = 20) -> TensorDataset:
    g = torch.Generator().manual_seed(100 + node)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def _grid(ratios: list[float], family: WidthFamily = FAMILY) -> InProcessGrid:
    app = ClientApp()

    @app.query()
    def _q(msg: Message, context: Any) -> Message:
        return handle_query(msg, float(context.node_config["keep-ratio"]),
                            str(context.node_config["key"]))

    @app.train()
    def _t(msg: Message, context: Any) -> Message:
        node = int(context.node_config["key"])
        return handle_width_train(msg, family, _data(node, 20 + 4 * node))

    return InProcessGrid(app, [{"keep-ratio": r, "key": i} for i, r in enumerate(ratios)])


def _strategy(method: str, rounds: int = 2, **slicing: Any) -> WidthSlicing:
    return WidthSlicing(family=FAMILY, num_rounds=rounds, sharding=Sharding(method=method),
                        slicing=Slicing(width_match="keep-ratio", **slicing),
                        training=LocalTraining(lr=0.1, local_epochs=1, batch_size=8,
                                               momentum=0.0),
                        replies=ReplyPolicy(max_update_spread=0.0, max_weight_ratio=0.0),
                        nodes=NodePolicy(),
                        cohort=Cohort(fraction_evaluate=0.0, min_available_nodes=4))


def _run(strategy: WidthSlicing, grid: InProcessGrid, rounds: int) -> Any:
    torch.manual_seed(0)
    initial = ArrayRecord(FAMILY(10).state_dict())
    return initial, strategy.start(grid, initial, num_rounds=rounds)


def _replies(grid: InProcessGrid) -> dict[int, Message]:
    """Capture each node's train reply as the server received it."""
    seen: dict[int, Message] = {}

    def keep(node: int):
        def hook(reply: Message) -> Message:
            seen[node] = copy.deepcopy(reply)
            return reply
        return hook

    for node in grid.contexts:
        grid.tamper[node] = keep(node)
    return seen


@pytest.mark.parametrize("method", ["heterofl", "fedrolex", "ordered-dropout"])
def test_one_round_is_the_brute_force_average_of_what_the_nodes_sent_back(method):
    grid = _grid([0.3, 0.3, 0.6, 1.0])
    seen = _replies(grid)
    initial, result = _run(_strategy(method, rounds=1), grid, 1)
    start = {k: P.decode_array(a) for k, a in initial.items()}
    want = {k: v.astype(np.float64).copy() for k, v in start.items()}
    num = {k: np.zeros_like(v) for k, v in want.items()}
    den = {k: np.zeros_like(v) for k, v in want.items()}
    trains = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert len(trains) == 4
    for msg in trains:
        node = msg.metadata.dst_node_id
        cfg = msg.content[P.CONFIG]
        order = SliceOrder.from_record(cfg)
        assert order.width == FAMILY.width_for(cfg[P.KEEP_RATIO])
        assert cfg["method"] == method
        reply = seen[node]
        weight = reply.content[P.METRICS][P.NUM_EXAMPLES]
        sent = {k: P.decode_array(a) for k, a in msg.content[P.ARRAYS].items()}
        back = {k: P.decode_array(a) for k, a in reply.content[P.ARRAYS].items()}
        k = order.width  # the papers' channels in round 1: FedRolex's window starts at 1
        rows = (1 + np.arange(k)) % 10 if method == "fedrolex" else np.arange(k)
        for key, value in back.items():
            # what was sent is the global model at the paper's channels
            ix = [rows if full == 10 and n < 10 else np.arange(n)
                  for n, full in zip(value.shape, start[key].shape, strict=True)]
            np.testing.assert_array_equal(sent[key], start[key][np.ix_(*ix)])
            for pos in np.ndindex(value.shape):
                at = tuple(int(i[p]) for i, p in zip(ix, pos, strict=True))
                num[key][at] += weight * float(value[pos])
                den[key][at] += weight
    for key in want:
        held = den[key] > 0
        want[key][held] = num[key][held] / den[key][held]
    got = {k: P.decode_array(a) for k, a in result.arrays.items()}
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-7)


def test_fedrolex_sends_the_rolled_window_of_each_round():
    """Round t's window is channels t, t+1, t+2 (mod 10) of the model round t started from."""
    grid = _grid([0.3, 0.3, 0.3, 0.3])
    models: dict[int, dict[str, np.ndarray]] = {}

    def keep(t: int, arrays: ArrayRecord) -> None:
        models[t] = {k: P.decode_array(a) for k, a in arrays.items()}

    torch.manual_seed(0)
    _strategy("fedrolex", rounds=12).start(grid, ArrayRecord(FAMILY(10).state_dict()),
                                           num_rounds=12, evaluate_fn=keep)
    by_round: Counter[int] = Counter()
    for msg in grid.sent:
        if msg.metadata.message_type != "train":
            continue
        t = msg.content[P.CONFIG][P.SERVER_ROUND]
        by_round[t] += 1
        window = [(t + j) % 10 for j in range(3)]
        sent = {k: P.decode_array(a) for k, a in msg.content[P.ARRAYS].items()}
        before = models[t - 1]
        np.testing.assert_array_equal(sent["a.weight"], before["a.weight"][window])
        np.testing.assert_array_equal(sent["b.weight"], before["b.weight"][window][:, window])
        np.testing.assert_array_equal(sent["c.weight"], before["c.weight"][:, window])
        np.testing.assert_array_equal(sent["c.bias"], before["c.bias"])
    assert by_round == {t: 4 for t in range(1, 13)}
    # over 10 rounds every hidden unit was trained: every row of a.weight moved
    moved = np.abs(models[12]["a.weight"] - models[0]["a.weight"]).sum(axis=1)
    assert (moved > 0).all()


def test_heterofl_scaler_divides_hidden_outputs_while_training_only():
    narrow = FAMILY(4)
    hooks = attach_scaler(narrow, FAMILY.hidden_layers(4), 0.4)
    assert FAMILY.hidden_layers(4) == ["a", "b"] and len(hooks) == 2
    x = torch.randn(3, 6)
    narrow.eval()
    plain = narrow.a(x)
    narrow.train()
    torch.testing.assert_close(narrow.a(x), plain / 0.4)
    torch.testing.assert_close(narrow.c(torch.ones(3, 4)), narrow.c(torch.ones(3, 4)))
    assert attach_scaler(narrow, ["a"], 1.0) == []
    with pytest.raises(ValueError, match="rate=0"):
        Scaler(0)
    with pytest.raises(KeyError, match="no module"):
        attach_scaler(narrow, ["zz"], 0.5)


def test_ordered_dropout_trains_the_leading_slice_of_the_drawn_width():
    torch.manual_seed(3)
    own = FAMILY(8)
    start = copy.deepcopy(own.state_dict())
    od = OrderedDropout(FAMILY, (2, 4, 8), seed=11)
    cfg = TrainConfig(recipe=LocalTraining(lr=0.1, momentum=0.0, local_epochs=1, batch_size=5),
                      step=od, log_every_epoch=False)
    step = od(own, cfg)
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
    step(x, y)
    w = step.drawn[0]
    # the drawn width's sub-model, built on its own from the leading slices, is what trained
    sub = FAMILY(w)
    sub.load_state_dict({k: v[tuple(slice(0, s) for s in sub.state_dict()[k].shape)]
                         for k, v in start.items()})
    loss = F.cross_entropy(sub(x), y)
    loss.backward()
    for name, p in sub.named_parameters():
        lead = tuple(slice(0, s) for s in p.shape)
        moved = own.state_dict()[name] - start[name]
        torch.testing.assert_close(moved[lead], -0.1 * p.grad, rtol=1e-5, atol=1e-6)
        rest = moved.clone()
        rest[lead] = 0
        assert torch.count_nonzero(rest) == 0, name


def test_ordered_dropout_draws_its_widths_uniformly_and_reproducibly():
    own = FAMILY(8)
    cfg = TrainConfig(recipe=LocalTraining(lr=1e-9, momentum=0.0), log_every_epoch=False)
    draws = []
    for _ in range(2):
        step = OrderedDropout(FAMILY, (2, 4, 8), seed=5)(own, cfg)
        for _ in range(600):
            step.loss(torch.randn(2, 6), torch.zeros(2, dtype=torch.long))
        draws.append(step.drawn)
    assert draws[0] == draws[1]
    counts = Counter(draws[0])
    assert set(counts) == {2, 4, 8} and all(150 < c < 250 for c in counts.values())


def test_ordered_dropout_distillation_adds_kl_to_the_own_widths_labels():
    torch.manual_seed(4)
    own = FAMILY(8)
    od = OrderedDropout(FAMILY, (4, 8), seed=0, distill=True)
    cfg = TrainConfig(recipe=LocalTraining(lr=1e-9, momentum=0.0), log_every_epoch=False)
    x, y = torch.randn(6, 6), torch.randint(0, 3, (6,))
    step = od(own, cfg)
    while True:
        loss, loss_sum, _, count = step.loss(x, y)
        if step.drawn[-1] == 4:
            break
    sub = FAMILY(4)
    sub.load_state_dict({k: v[tuple(slice(0, s) for s in sub.state_dict()[k].shape)]
                         for k, v in own.state_dict().items()})
    teacher = own(x)
    kl = (F.softmax(teacher, -1) * (F.log_softmax(teacher, -1) - F.log_softmax(sub(x), -1))
          ).sum(-1).mean()
    ce = F.cross_entropy(teacher, y)
    torch.testing.assert_close(loss, ce + kl, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss_sum / count, ce, rtol=1e-5, atol=1e-6)


def test_ordered_dropout_grid_below_the_nodes_width():
    assert od_widths(FAMILY, 6, 5) == (2, 4, 6)  # ratios 0.2, 0.4 below 6 of 10, then 6
    assert od_widths(FAMILY, 10, 5) == (2, 4, 6, 8, 10)
    assert od_widths(FAMILY, 1, 5) == (1,)


def test_a_node_with_another_family_replies_an_error_the_server_drops(caplog):
    other = WidthFamily(Net, 12)
    app = ClientApp()

    @app.query()
    def _q(msg: Message, context: Any) -> Message:
        return handle_query(msg, 0.5, str(context.node_config["key"]))

    @app.train()
    def _t(msg: Message, context: Any) -> Message:
        fam = other if context.node_config["key"] == 0 else FAMILY
        return handle_width_train(msg, fam, _data(1))

    grid = InProcessGrid(app, [{"key": i} for i in range(4)])
    caplog.set_level(logging.WARNING)
    strategy = _strategy("heterofl", rounds=1)
    _run(strategy, grid, 1)
    row = strategy.history[1]
    assert row["replies-used"] == 3 and row["dropped-error-reply"] == 1
    assert "widths 1..12" in caplog.text and "same model" in caplog.text


def test_a_reply_of_the_wrong_shape_is_dropped_not_aggregated():
    grid = _grid([0.5, 0.5, 0.5, 0.5])

    def widen(reply: Message) -> Message:
        arrays = {k: P.decode_array(a) for k, a in reply.content[P.ARRAYS].items()}
        arrays["a.weight"] = np.zeros((10, 6), np.float32)
        reply.content[P.ARRAYS] = P.array_record({k: P.encode_array(v)
                                                  for k, v in arrays.items()})
        return reply

    grid.tamper[grid_node(grid, 2)] = widen
    strategy = _strategy("heterofl", rounds=1)
    _run(strategy, grid, 1)
    assert strategy.history[1]["dropped-bad-shape"] == 1
    assert strategy.history[1]["replies-used"] == 3


def grid_node(grid: InProcessGrid, key: int) -> int:
    return next(n for n, c in grid.contexts.items() if c.node_config["key"] == key)


def test_each_strategy_refuses_the_others_methods_and_bad_settings():
    with pytest.raises(SettingsError, match=r"use fedshard\.WidthSlicing"):
        SpectralSharding(sharded_layers=["b"], sharding=Sharding(method="heterofl"))
    with pytest.raises(SettingsError, match=r"use fedshard\.SpectralSharding"):
        WidthSlicing(family=FAMILY, sharding=Sharding(method="collective"),
                     slicing=Slicing(width_match="keep-ratio"))
    with pytest.raises(SettingsError, match="expected 'mean'"):
        WidthSlicing(family=FAMILY, slicing=Slicing(width_match="keep-ratio"),
                     replies=ReplyPolicy(aggregation="median"))
    with pytest.raises(SettingsError, match="needs the model"):
        WidthSlicing(family=FAMILY)
    with pytest.raises(SettingsError, match="no terms to scale"):
        Sharding(method="fedrolex", scaled=True)
    with pytest.raises(SettingsError, match="width slicing has no terms"):
        Sharding(method="fedrolex", fedavg_cosine=True)
    with pytest.raises(SettingsError, match="od_widths"):
        Slicing(od_widths=0)


def test_from_model_matches_widths_on_flops_and_logs_the_match(caplog):
    model = FAMILY(10)
    strategy = WidthSlicing.from_model(model, family=FAMILY, example_input=torch.zeros(1, 6),
                                       method="fedrolex", num_rounds=1)
    caplog.set_level(logging.INFO)
    match = strategy.width_of(0.2)
    assert strategy.sharding.method == "fedrolex" and strategy.slicing.width_match == "flops"
    assert match.width == strategy.width_of(0.2).width  # counted once
    assert "keep ratio 0.2 -> width" in caplog.text


def test_slice_order_checks_what_it_reads():
    cfg = SliceOrder(4, 10, od_widths=(2, 4)).to_record(P.TrainSettings.of(
        LocalTraining(lr=0.1), lr=0.1, server_round=1, keep_ratio=0.4, method="heterofl",
        train_seed=1).to_record())
    assert {k: cfg[k] for k in SLICE_ORDER_KEYS} == {
        "slice-width": 4, "model-width": 10, "slice-scaler": False, "od-batch-widths": [2, 4],
        "od-distill": False}
    assert SliceOrder.from_record(cfg) == SliceOrder(4, 10, False, (2, 4), False)
    # every problem at once, named by its wire key
    with pytest.raises(ValueError, match=r"\(2 problem\(s\)\); the node cannot build its narrow "
                                         r"model(.|\n)*slice-scaler='yes': expected True or "
                                         r"False(.|\n)*slice-width=11 with model-width=10: "
                                         r"expected the narrow width to be at most the global"):
        SliceOrder(11, 10, scaler="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"od-batch-widths=\(4, 2\): expected ascending"):
        SliceOrder(4, 10, od_widths=(4, 2))
    with pytest.raises(ValueError, match=r"od-batch-widths=\(2, 3\) with slice-width=4: "
                                         r"expected ordered dropout's widths to end with"):
        SliceOrder(4, 10, od_widths=(2, 3))
    with pytest.raises(ValueError, match=r"missing \['slice-width', 'model-width'\]"):
        SliceOrder.from_record({})
    # a message without the optional keys is a method without scaler and ordered dropout
    assert SliceOrder.from_record({"slice-width": 3, "model-width": 10}) == SliceOrder(3, 10)


def test_slice_order_keys_are_declared_once_and_mean_one_thing():
    """The wire keys come from the fields' declarations (settings.setting(wire=...)); a key
    that is also a run-config key means the same there (the global width, self-distillation
    on); the narrow width, the node's scaler and the batch widths, which mean something else
    than the run config's model-width, width-scaler and od-widths, have keys of their own."""
    from dataclasses import fields

    from fedshard.app.config import RunConfig
    from fedshard.settings import Slicing, run_key, wire_key

    declared = tuple(wire_key(f) for f in fields(SliceOrder))
    assert declared == SLICE_ORDER_KEYS and len(set(declared)) == len(declared)
    assert not set(declared) & set(P.TRAIN_CONFIG_KEYS)  # no clash with the recipe's keys
    run_keys = {run_key(f) for f in fields(Slicing)} | {"model-width"}
    assert set(declared) & run_keys == {"model-width", "od-distill"}
    cfg = RunConfig.from_mapping({"model": "mlp", "model-width": 10, "method": "heterofl",
                                  "od-distill": True})
    assert cfg.model_width == SliceOrder.from_record({"slice-width": 4, "model-width": 10}
                                                     ).full_width


def test_the_trained_model_learns(caplog):
    """Three rounds of HeteroFL on separable data lower the nodes' training loss."""
    grid = _grid([0.5, 0.5, 1.0, 1.0])
    strategy = _strategy("heterofl", rounds=3)
    _run(strategy, grid, 3)
    losses = [strategy.history[t]["train-loss"] for t in (1, 2, 3)]
    assert losses[2] < losses[0]
    assert train is not None  # the node trains with fedshard's loop (handle_train)


@pytest.mark.parametrize("method,ratios,warned", [
    ("heterofl", [0.3, 0.3, 0.6, 0.6], True), ("ordered-dropout", [0.5] * 4, True),
    ("fedrolex", [0.3] * 4, False), ("heterofl", [0.3, 0.3, 1.0, 1.0], False)])
def test_untrained_channels_are_named_once_where_no_node_trains_them(method, ratios, warned,
                                                                    caplog):
    grid = _grid(ratios)
    caplog.set_level(logging.WARNING)
    _run(_strategy(method, rounds=2), grid, 2)
    said = [r for r in caplog.records if "no node trains beyond width" in r.getMessage()]
    assert len(said) == (1 if warned else 0)
    if warned:
        widest = FAMILY.width_for(max(ratios))
        assert f"beyond width {widest} of 10" in said[0].getMessage()
