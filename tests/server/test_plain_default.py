"""The library's strategy is the paper's round by default: with data sizes 100× apart, one
round of ``SpectralSharding()`` is the data-weighted per-term mean of the returned factors,
computed here from the replies in numpy; ``robust_defaults()`` is the app's robust rules."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flower_grid import InProcessGrid
from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from test_strategy import LAYERS, initial, make_net

from fedshard import (
    Cohort,
    LocalTraining,
    NodePolicy,
    ReplyPolicy,
    Sharding,
    SpectralSharding,
    handle_query,
    receive,
    robust_defaults,
)
from fedshard.app.config import RunConfig

SIZES = {0: 10, 1: 12, 2: 11, 3: 1000}  # partition -> num-examples: one node 100× the others


def _app(returned: dict[int, dict[str, np.ndarray]]) -> ClientApp:
    app = ClientApp()

    @app.query()
    def _q(msg: Message, context: Context) -> Message:
        return handle_query(msg, 1.0, context.node_config["partition-id"])

    @app.train()
    def _t(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        shard = receive(msg, make_net())
        rng = np.random.default_rng([5, pid])
        for _, param in shard.model.named_parameters():
            if param.requires_grad:  # an update of its own, unlike the others'
                param.data += 0.05 * (pid + 1) * torch.as_tensor(
                    rng.normal(size=tuple(param.shape)), dtype=param.dtype)
        returned[pid] = {k: v.detach().numpy().astype(np.float64).copy()
                         for k, v in shard.model.state_dict().items()}
        return shard.reply(num_examples=SIZES[pid])

    return app


def _round(replies: ReplyPolicy | None) -> tuple[dict[str, np.ndarray],
                                                 dict[int, dict[str, np.ndarray]]]:
    returned: dict[int, dict[str, np.ndarray]] = {}
    kw = {} if replies is None else {"replies": replies}
    s = SpectralSharding(sharded_layers=LAYERS, sharding=Sharding(method="unbiased"),
                         training=LocalTraining(lr=0.05), seed=2, num_rounds=1,
                         cohort=Cohort(min_train_nodes=4, min_available_nodes=4,
                                       fraction_evaluate=0.0),
                         nodes=NodePolicy(query_timeout=5, node_wait_timeout=5), **kw)
    grid = InProcessGrid(_app(returned), [{"partition-id": i} for i in range(4)])
    result = s.start(grid=grid, initial_arrays=initial(), num_rounds=1, timeout=5)
    assert s.rounds_trained == 1
    return {k: v.numpy().astype(np.float64) for k, v in result.arrays.items()}, returned


def test_the_default_round_is_the_papers_data_weighted_per_term_mean() -> None:
    assert ReplyPolicy() == ReplyPolicy(max_weight_ratio=0.0, align_factors=False,
                                        max_update_spread=0.0)
    new, returned = _round(None)
    total = sum(SIZES.values())

    def mean(key: str) -> np.ndarray:  # Σ_k D_k x_k / Σ_k D_k over the 4 holders
        return sum(SIZES[p] * returned[p][key] for p in SIZES) / total

    for layer in LAYERS:  # at r = 1 every node holds every term: W' = Ū V̄ᵀ (ω = 1)
        u, v = mean(f"{layer}.u"), mean(f"{layer}.v")
        w = (u @ v.T).reshape(new[f"{layer}.weight"].shape)
        np.testing.assert_allclose(new[f"{layer}.weight"], w, rtol=1e-5, atol=1e-6)
    for key in ("stem.weight", "head.weight", "norm.weight", f"{LAYERS[0]}.bias"):
        np.testing.assert_allclose(new[key], mean(key), rtol=1e-5, atol=1e-6)


def test_robust_defaults_are_the_apps_defaults_and_discount_the_outsized_claim() -> None:
    preset = robust_defaults()
    assert RunConfig().replies == preset
    assert (preset.max_weight_ratio, preset.align_factors, preset.max_update_spread) == (
        2.0, True, 2.0)
    assert robust_defaults(max_update_spread=3.0).max_update_spread == 3.0
    robust, returned = _round(preset)
    plain, _ = _round(None)
    # the 1000-example node pulls the plain mean to itself (weight 1000 of 1033); the robust
    # rules weight it as a typical node (the median claim, 11 of 44): the robust model is
    # less than half as far from the other three's mean
    small = {p: SIZES[p] for p in (0, 1, 2)}
    others = sum(small[p] * returned[p]["head.weight"] for p in small) / sum(small.values())
    assert (np.abs(robust["head.weight"] - others).max()
            < 0.5 * np.abs(plain["head.weight"] - others).max())
    with pytest.raises(TypeError):
        robust_defaults(no_such_setting=1)
