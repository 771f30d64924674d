"""Central differential privacy for factor shards and width slices
(:mod:`fedshard.server.central_dp`): the mechanism against its formulas (Monte Carlo of the
noise's variance, the bound on one node's pull), the accountant against Opacus's own, runs of
both strategy families and of fedshard's app with a DP target, the node-side clipping mod,
and the errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import fakedata
import numpy as np
import pytest
import torch
from flower_grid import InProcessGrid
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common import MessageType
from opacus.accountants import RDPAccountant
from opacus.accountants.utils import get_noise_multiplier
from test_strategy import client, initial, make_net, strategy
from torch import nn
from torch.utils.data import TensorDataset

from fedshard import (
    LocalTraining,
    Privacy,
    ReplyPolicy,
    SettingsError,
    Sharding,
    ShardingClientApp,
    Slicing,
    TrustedReference,
    WidthFamily,
    WidthSlicing,
    clip_update_mod,
    handle_query,
    receive,
    robust_defaults,
)
from fedshard import protocol as P
from fedshard.app.config import ConfigError, RunConfig
from fedshard.client.width import handle_width_train
from fedshard.server import central_dp as dp
from fedshard.spectral.aggregate import TermUpdate
from fedshard.spectral.decompose import layer_spectrum
from fedshard_lab.engine import run_engine

SIGMA, S = 0.7, 2.0


# --------------------------------------------------------------------------- the mechanism
def _layer(rng: np.random.Generator, c_out: int = 6, c_in: int = 5):
    return layer_spectrum(rng.normal(size=(c_out, c_in)).astype(np.float32))


#: term sets of four nodes of a layer of 5 terms: holder counts 4, 3, 2, 1, 1
TERM_SETS = [np.array([0, 1, 2, 3]), np.array([0, 1, 4]), np.array([0, 1, 2]), np.array([0])]


def _sent(spec) -> list[TermUpdate]:
    """What each node was sent: the spectrum's own columns of its terms."""
    return [TermUpdate(1.0, idx, spec.ut[idx].T.copy(), spec.vt[idx].T.copy())
            for idx in TERM_SETS]


def _holders(n_terms: int) -> np.ndarray:
    """Brute force: how many of TERM_SETS hold each term."""
    return np.array([sum(int(i in idx) for idx in TERM_SETS) for i in range(n_terms)])


def test_each_terms_noise_has_variance_sigma2_s2_over_count2() -> None:
    """Monte Carlo over 3000 seeds of nodes that return what they were sent: the noise on
    each held term's mean (every coordinate of u and v pooled, 3000 × 11 draws per term) has
    variance σ²S²/m_i², within 6 % (the estimate's relative standard error is about
    √(2/33000) ≈ 0.8 %); a term nobody holds is not touched."""
    spec = _layer(np.random.default_rng(0))
    sent = _sent(spec)
    m = _holders(spec.lam.size)
    draws = []
    for seed in range(3000):
        held, u, v, count = dp.noisy_term_means(spec, sent, SIGMA * S, seed=seed,
                                                server_round=1, entry=0)
        draws.append(np.hstack([u - spec.ut[held], v - spec.vt[held]]))  # (h, c_out + c_in)
    noise = np.stack(draws)  # (seeds, h, c_out + c_in)
    assert held.tolist() == [0, 1, 2, 3, 4] and count.tolist() == m[held].tolist()
    ratio = noise.var(axis=(0, 2)) / (SIGMA**2 * S**2 / m[held] ** 2)
    assert np.all(np.abs(ratio - 1) < 0.06), ratio
    assert np.all(np.abs(noise.mean(axis=(0, 2))) < 4 * SIGMA * S / m[held] / np.sqrt(33000))


def test_dense_entries_and_slice_elements_get_the_same_variance() -> None:
    """A dense entry over its M replies: σ²S²/M²; a width slice's element over the nodes that
    trained it: σ²S²/m_e² (brute-force counts), within 6 % over 3000 seeds."""
    current = {"bias": np.zeros(8, dtype=np.float32), "steps": np.array(3)}
    replies = [{"bias": np.zeros(8)} for _ in range(3)]
    index = [{"bias": (np.arange(k),), "steps": ()} for k in (8, 5, 2)]
    got_dense, got_slices = [], []
    for seed in range(3000):
        got_dense.append(dp.noisy_state(current, {}, replies, [{}] * 3, SIGMA * S, seed=seed,
                                        server_round=2)["bias"])
        got_slices.append(dp.noisy_slices(current, [{"bias": np.zeros(k)} for k in (8, 5, 2)],
                                          index, SIGMA * S, seed=seed,
                                          server_round=2)["bias"])
    ratio = np.var(got_dense, axis=0).mean() / (SIGMA**2 * S**2 / 9)
    assert abs(ratio - 1) < 0.06, ratio
    m = np.array([3, 3, 2, 2, 2, 1, 1, 1])  # nodes holding element j: brute force above
    ratio_e = np.var(got_slices, axis=0) / (SIGMA**2 * S**2 / m**2)
    assert np.all(np.abs(np.array([ratio_e[:2].mean(), ratio_e[2:5].mean(), ratio_e[5:].mean()])
                         - 1) < 0.06), ratio_e
    out = dp.noisy_slices(current, [{"bias": np.zeros(8)}], index[:1], 1.0, seed=0,
                          server_round=2)
    assert out["steps"] == 3  # integer entries are kept


def test_one_node_1e6_times_larger_moves_each_term_by_at_most_s_over_its_holders() -> None:
    """Node 0 returns its update (its terms and the dense entry) × 1e6 instead of nothing:
    with the same noise streams, each term's mean moves by at most S/m_i, the dense entry's
    by at most S/M, and the whole move weighted by the counts is at most S (the Gaussian
    mechanism's sensitivity). Without the clip it would move by ~1e6."""
    rng = np.random.default_rng(1)
    spec = _layer(rng)
    sent = _sent(spec)
    bias = rng.normal(size=4)

    def values(t: TermUpdate, b: np.ndarray) -> dict[str, np.ndarray]:
        return {"l.u": t.u, "l.v": t.v, "l.indices": t.indices, "bias": b}

    honest = [values(TermUpdate(1.0, t.indices, t.u + 0.01 * rng.normal(size=t.u.shape),
                                t.v + 0.01 * rng.normal(size=t.v.shape)),
                     bias + 0.01 * rng.normal(size=4)) for t in sent]
    sent_values = [values(t, bias) for t in sent]

    def aggregate(first: dict[str, np.ndarray], clip: bool = True):
        replies = [first, *honest[1:]]
        if clip:
            replies = [dp.clip_change(s, r, S)[0] for s, r in zip(sent_values, replies,
                                                                   strict=True)]
        ups = [TermUpdate(1.0, r["l.indices"], r["l.u"], r["l.v"]) for r in replies]
        _, u, v, count = dp.noisy_term_means(spec, ups, SIGMA * S, seed=5, server_round=1,
                                             entry=0)
        dense = dp.noisy_state({"bias": bias}, {}, replies, [{}] * 4, SIGMA * S, seed=5,
                               server_round=1)["bias"]
        return u, v, dense, count

    zero = sent_values[0]
    big = {k: (s + 1e6 * (h - s) if k != "l.indices" else s)
           for (k, s), h in zip(zero.items(), honest[0].values(), strict=True)}
    u0, v0, d0, count = aggregate(zero)
    u1, v1, d1, _ = aggregate(big)
    moved = np.sqrt(((u1 - u0) ** 2).sum(1) + ((v1 - v0) ** 2).sum(1))  # (h,)
    assert np.all(moved <= S / count + 1e-9), (moved, S / count)
    assert np.linalg.norm(d1 - d0) <= S / 4 + 1e-9
    total = np.sqrt(((count * moved) ** 2).sum() + (4 * np.linalg.norm(d1 - d0)) ** 2)
    assert total <= S + 1e-9
    assert total > 0.99 * S  # the clipped update is used, at its bound
    u2, *_ = aggregate(big, clip=False)
    assert np.abs(u2 - u0).max() > 1e3


def test_the_noise_streams_are_seeded_by_seed_round_and_entry() -> None:
    spec = _layer(np.random.default_rng(2))
    sent = _sent(spec)

    def draw(seed: int, server_round: int, entry: int) -> np.ndarray:
        return dp.noisy_term_means(spec, sent, 1.0, seed=seed, server_round=server_round,
                                   entry=entry)[1]

    assert np.array_equal(draw(0, 1, 0), draw(0, 1, 0))
    assert not np.allclose(draw(0, 1, 0), draw(0, 2, 0))
    assert not np.allclose(draw(0, 1, 0), draw(1, 1, 0))
    assert not np.allclose(draw(0, 1, 0), draw(0, 1, 1))


def test_clip_change_scales_the_whole_update_as_one_vector() -> None:
    sent = {"a": np.zeros(3), "b": np.ones(2, dtype=np.float32), "i": np.arange(2)}
    got = {"a": np.array([3.0, 0, 0]), "b": np.array([1.0, 5.0], dtype=np.float32),
           "i": np.arange(2)}
    out, norm = dp.clip_change(sent, got, 1.0)
    assert norm == pytest.approx(5.0)
    assert np.allclose(out["a"], [0.6, 0, 0]) and np.allclose(out["b"], [1.0, 1.8])
    assert out["i"] is got["i"]
    same, _ = dp.clip_change(sent, got, 10.0)
    assert np.allclose(same["a"], got["a"]) and np.allclose(same["b"], got["b"])


# --------------------------------------------------------------------------- the accountant
def test_the_spent_epsilon_is_opacus_own_for_the_same_sigma_rate_and_rounds() -> None:
    """A run of 3 rounds at σ = 1.3 sampling 2 of 4 nodes: every round's ``dp-epsilon`` is
    what Opacus's RDPAccountant, stepped as many times at (σ, q = 0.5), says."""
    s = strategy(num_rounds=3, fraction_train=0.5, min_available_nodes=4,
                 privacy=Privacy(noise_multiplier=1.3, clipping_norm=1.0))
    s.start(grid=InProcessGrid(client, [{"keep-ratio": 0.5}] * 4), initial_arrays=initial(),
            num_rounds=3, timeout=5)
    reference = RDPAccountant()
    for server_round in (1, 2, 3):
        reference.step(noise_multiplier=1.3, sample_rate=0.5)
        row = s.history[server_round]
        assert row["dp-sample-rate"] == 0.5 and row["dp-noise-multiplier"] == 1.3
        assert row["dp-epsilon"] == pytest.approx(reference.get_epsilon(1e-5), rel=1e-12)
        assert row["dp-rounds"] == server_round and row["dp-delta"] == 1e-5
    resumed = strategy(num_rounds=5, fraction_train=0.5, min_available_nodes=4,
                       privacy=Privacy(noise_multiplier=1.3, clipping_norm=1.0))
    resumed.resume(3, s.capability_table(), s.history)  # the accountant from the metrics
    assert resumed.central_dp is not None and s.central_dp is not None
    assert resumed.central_dp.history == s.central_dp.history == [(1.3, 0.5, 3)]


def test_a_target_calibrates_sigma_as_opacus_does_and_spends_at_most_it() -> None:
    s = strategy(num_rounds=2, privacy=Privacy(target_epsilon=4.0, clipping_norm=1.0))
    s.start(grid=InProcessGrid(client, [{"keep-ratio": 0.5}] * 3), initial_arrays=initial(),
            num_rounds=2, timeout=5)
    sigma = get_noise_multiplier(target_epsilon=4.0, target_delta=1e-5, sample_rate=1.0,
                                 steps=2, accountant="rdp")
    assert s.history[2]["dp-noise-multiplier"] == pytest.approx(sigma)
    assert 3.9 <= s.history[2]["dp-epsilon"] <= 4.0


# --------------------------------------------------------------------------- whole runs
def test_a_spectral_run_with_a_target_trains_and_logs_its_budget(
        caplog: pytest.LogCaptureFixture) -> None:
    s = strategy(num_rounds=3, privacy=Privacy(target_epsilon=8.0, clipping_norm=1.0),
                 replies=ReplyPolicy())
    assert s.replies.max_update_spread == 0.0 and s.replies.max_weight_ratio == 0.0
    with caplog.at_level("INFO", logger="flwr"):
        result = s.start(grid=InProcessGrid(client, [{"keep-ratio": 0.5}] * 4),
                         initial_arrays=initial(), num_rounds=3, timeout=5)
    eps = [s.history[r]["dp-epsilon"] for r in (1, 2, 3)]
    assert eps == sorted(eps) and eps[0] > 0 and eps[-1] <= 8.0
    assert s.rounds_trained == 3
    before, after = initial(), result.arrays
    assert all(np.isfinite(after[k].numpy()).all() for k in after)
    assert any(not np.array_equal(before[k].numpy(), after[k].numpy()) for k in before)
    text = caplog.text
    assert "central DP has spent ε=" in text and "central DP noise multiplier σ=" in text
    assert "central DP: each node's update clipped to S=1" in text  # the settings summary


def test_a_node_sending_1e6_times_its_values_moves_the_round_by_little() -> None:
    """Two one-round spectral runs with the same seeds (so the same noise): in the second,
    node 0 sends every array × 1e6 (the update bound off). Each dense entry moves by at most
    2S / M (two clipped updates of norm ≤ S, M = 4 replies), the sharded weights by far less
    than the ~1e6 the reply carries: the server clips the whole update, factors included."""
    runs = []
    for tampered in (False, True):
        s = strategy(num_rounds=1, privacy=Privacy(noise_multiplier=0.3, clipping_norm=S),
                     replies=ReplyPolicy(max_update_ratio=0.0))
        grid = InProcessGrid(client, [{"keep-ratio": 0.5}] * 4)
        if tampered:
            def huge(reply: Message) -> Message:
                rec = reply.content[P.ARRAYS]
                for k in list(rec.keys()):
                    x = rec[k].numpy()
                    if np.issubdtype(x.dtype, np.floating):
                        rec[k] = Array(np.ascontiguousarray(x * 1e6))
                return reply
            grid.tamper[1000] = huge
        runs.append(s.start(grid=grid, initial_arrays=initial(), num_rounds=1,
                            timeout=5).arrays)
    a, b = ({k: r[k].numpy().astype(np.float64) for k in r} for r in runs)
    for key in ("stem.bias", "head.bias", "head.weight", "norm.weight"):
        assert np.linalg.norm(b[key] - a[key]) <= 2 * S / 4 + 1e-5, key
    for layer in ("body", "hidden"):
        assert 0 < np.abs(b[f"{layer}.weight"] - a[f"{layer}.weight"]).max() < 10 * S


def test_without_privacy_settings_nothing_changes() -> None:
    plain, off = strategy(), strategy(privacy=Privacy())
    assert plain.central_dp is None and off.central_dp is None
    assert off.replies.max_update_spread == robust_defaults().max_update_spread  # unchanged
    results = []
    for s in (plain, off):
        results.append(s.start(grid=InProcessGrid(client, [{"keep-ratio": 0.5}] * 3),
                               initial_arrays=initial(), num_rounds=2, timeout=5).arrays)
        assert not any(k.startswith("dp-") for row in s.history.values() for k in row)
    assert all(np.array_equal(results[0][k].numpy(), results[1][k].numpy())
               for k in results[0])


class _Net(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, width), nn.Linear(width, width), nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


FAMILY = WidthFamily(_Net, 10)


def _width_grid(ratios: list[float]) -> InProcessGrid:
    app = ClientApp()

    @app.query()
    def _q(msg: Message, context: Any) -> Message:
        return handle_query(msg, float(context.node_config["keep-ratio"]),
                            str(context.node_config["key"]))

    @app.train()
    def _t(msg: Message, context: Any) -> Message:
        g = torch.Generator().manual_seed(int(context.node_config["key"]))
        data = TensorDataset(torch.randn(20, 6, generator=g),
                             torch.randint(0, 3, (20,), generator=g))
        return handle_width_train(msg, FAMILY, data)

    return InProcessGrid(app, [{"keep-ratio": r, "key": i} for i, r in enumerate(ratios)])


def test_a_width_run_noises_each_element_over_its_nodes() -> None:
    """HeteroFL with DP: the first round's new model, recomputed from the replies the nodes
    sent (clipped to S by hand, summed per element, the noise from the documented streams,
    divided by the nodes holding the element), is the strategy's."""
    s = WidthSlicing(family=FAMILY, num_rounds=1, sharding=Sharding(method="heterofl"),
                     slicing=Slicing(width_match="keep-ratio"),
                     training=LocalTraining(lr=0.1, batch_size=8, momentum=0.0),
                     privacy=Privacy(noise_multiplier=0.5, clipping_norm=0.05), seed=4)
    grid = _width_grid([0.5, 1.0, 0.5])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        net = FAMILY(10)
    start = {k: v.detach().numpy().copy() for k, v in net.state_dict().items()}
    replies: dict[int, dict[str, np.ndarray]] = {}
    sent: dict[int, dict[str, np.ndarray]] = {}
    original = grid.push_messages

    def push(messages: Any) -> Any:
        messages = list(messages)
        ids = list(original(messages))
        for m in messages:
            if m.metadata.message_type == MessageType.TRAIN:
                node = m.metadata.dst_node_id
                sent[node] = {k: a.numpy().copy() for k, a in m.content[P.ARRAYS].items()}
                reply = grid._replies[m.metadata.message_id].content[P.ARRAYS]
                replies[node] = {k: a.numpy().copy() for k, a in reply.items()}
        return ids

    grid.push_messages = push  # type: ignore[method-assign]
    out = s.start(grid=grid, initial_arrays=ArrayRecord(net.state_dict()), num_rounds=1,
                  timeout=5).arrays
    expected = {}
    for entry, (key, now) in enumerate(start.items()):
        total = np.zeros(now.shape)
        count = np.zeros(now.shape)
        for node in sorted(replies):
            d = {k: replies[node][k].astype(np.float64) - sent[node][k] for k in sent[node]}
            norm = np.sqrt(sum((x**2).sum() for x in d.values()))
            at = tuple(slice(0, n) for n in sent[node][key].shape)
            total[at] += sent[node][key] + d[key] * min(1.0, 0.05 / norm)
            count[at] += 1
        z = np.random.default_rng([4, 1, 3, entry, 0]).normal(0.0, 0.5 * 0.05, now.shape)
        expected[key] = ((total + z) / count).astype(now.dtype)
    for key, value in expected.items():
        assert np.allclose(out[key].numpy(), value, rtol=1e-6, atol=1e-7), key
    assert s.history[1]["dp-fewest-holders"] == 1.0  # the width-1.0 node alone holds some


def test_fedshards_app_on_the_engine_runs_both_families_with_a_dp_target(
        tmp_path: Path) -> None:
    """fedshard's app (run config keys dp-*) on the in-process engine: every round's metrics
    carry the spent ε, within the target at the end; the model is finite."""
    data = tmp_path / "data"
    fakedata.write_fashion_mnist(data, 120, 20, np.random.default_rng(6))
    for method in ("collective", "heterofl"):
        cfg = RunConfig.from_mapping({
            "dataset": "fashion-mnist", "data-dir": str(data), "num-partitions": 4,
            "min-available-nodes": 4, "batch-size": 8, "num-server-rounds": 2, "seed": 3,
            "model": "mlp", "model-width": 16, "method": method, "download": False,
            "keep-ratios": "0.25:0.5,0.5:0.5", "results-dir": str(tmp_path),
            "run-name": method, "test-max-examples": 20, "client-device": "cpu",
            "server-device": "cpu", "width-match": "keep-ratio", "dp-target-epsilon": 8.0,
            "dp-clipping-norm": 1.0})
        assert cfg.privacy == Privacy(target_epsilon=8.0, clipping_norm=1.0)
        assert run_engine(cfg, 4)["rounds-completed"] == 2
        rows = [json.loads(x) for x in (tmp_path / method / "metrics.jsonl").read_text()
                .splitlines()]
        eps = [r["dp-epsilon"] for r in rows if "dp-epsilon" in r]
        assert len(eps) == 2 and 0 < eps[0] < eps[1] <= 8.0, eps
        model = torch.load(tmp_path / method / "model.pt", weights_only=True)
        assert all(torch.isfinite(v).all() for v in model.values())


def test_a_run_config_without_dp_keys_is_off_and_bad_dp_keys_are_named() -> None:
    assert not RunConfig.from_mapping({}).privacy.enabled
    with pytest.raises(ConfigError, match=r"dp-clipping-norm=None: expected S > 0"):
        RunConfig.from_mapping({"dp-target-epsilon": 4.0})
    with pytest.raises(ConfigError, match=r"dp-target-delta=2.0: expected δ in \(0, 1\)"):
        RunConfig.from_mapping({"dp-target-delta": 2.0})


# --------------------------------------------------------------------------- the errors
def test_privacy_settings_report_every_problem() -> None:
    with pytest.raises(SettingsError) as err:
        Privacy(target_epsilon=-1.0, target_delta=0.0, clipping_norm=float("nan"),
                min_holders=0)
    text = str(err.value)
    assert "4 problem(s)" in text and "expected ε in (0, 1000]" in text
    assert "expected δ in (0, 1)" in text
    with pytest.raises(SettingsError, match=r"expected one of them: σ is either calibrated"):
        Privacy(target_epsilon=1.0, noise_multiplier=1.0, clipping_norm=1.0)
    with pytest.raises(SettingsError, match=r"clipping_norm=1.0: expected a target_epsilon or "
                                            r"a noise_multiplier with it"):
        Privacy(clipping_norm=1.0)
    with pytest.raises(SettingsError, match=r"clipping_norm=None: expected S > 0"):
        Privacy(noise_multiplier=1.0)


def test_the_strategies_refuse_what_central_dp_cannot_run_with() -> None:
    on = Privacy(target_epsilon=1.0, clipping_norm=1.0)
    with pytest.raises(SettingsError, match=r"aggregation='median': central DP bounds"):
        strategy(privacy=on, replies=ReplyPolicy(aggregation="median"))
    with pytest.raises(SettingsError, match=r"target_epsilon=1.0 with num_rounds=None: σ is "
                                            r"calibrated"):
        strategy(privacy=on, num_rounds=None)
    with pytest.raises(SettingsError, match=r"privacy=3: expected a Privacy"):
        strategy(privacy=3)
    with pytest.raises(SettingsError, match=r"target_epsilon=1.0 with num_rounds=None"):
        WidthSlicing(family=FAMILY, slicing=Slicing(width_match="keep-ratio"), privacy=on)
    # defences that drop or re-weight nodes by their updates: the holder counts would depend
    # on the data
    with pytest.raises(SettingsError, match=r"trusted=.*Expected one of the two: privacy, or "
                                            r"trusted"):
        strategy(privacy=on, trusted=TrustedReference(lambda model, sent: model))
    with pytest.raises(SettingsError, match=r"exclude_distrusted=True: excluding nodes by "
                                            r"their past updates"):
        strategy(privacy=on, replies=ReplyPolicy(exclude_distrusted=True))


def test_without_opacus_dp_is_refused_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "opacus.accountants", None)
    with pytest.raises(ImportError, match=r"install the dp extra: pip install "
                                          r"\"fedshard\[dp\]\" \(opacus\)\. No round"):
        strategy(privacy=Privacy(noise_multiplier=1.0, clipping_norm=1.0))
    assert strategy().central_dp is None  # without DP opacus is never imported


# --------------------------------------------------------------------------- the node's mod
def _shard_app(clipping_norm: float) -> ClientApp:
    app = ShardingClientApp(default_keep_ratio=0.5, clipping_norm=clipping_norm)

    @app.train()
    def _t(msg: Message, context: Context) -> Message:
        shard = receive(msg, make_net())
        with torch.no_grad():
            for p in shard.model.parameters():
                if p.requires_grad:
                    p.add_(1.0)  # a large update: a norm far above S
        return shard.reply(num_examples=10)

    return app


def test_the_node_side_mod_clips_the_whole_update_and_passes_queries() -> None:
    """``ShardingClientApp(clipping_norm=0.5)``: every reply's change from what the node was
    sent has norm 0.5 (the server then clips again, a no-op, and adds the noise); the
    capability query is answered as without it."""
    s = strategy(num_rounds=1, privacy=Privacy(noise_multiplier=1.0, clipping_norm=0.5))
    grid = InProcessGrid(_shard_app(0.5), [{}] * 3)
    seen: list[float] = []
    original = grid.push_messages

    def push(messages: Any) -> Any:
        messages = list(messages)
        ids = list(original(messages))
        for m in messages:
            if m.metadata.message_type != MessageType.TRAIN:
                continue
            reply = grid._replies[m.metadata.message_id]
            sent, got = m.content[P.ARRAYS], reply.content[P.ARRAYS]
            d = [got[k].numpy().astype(np.float64) - sent[k].numpy() for k in got
                 if np.issubdtype(got[k].numpy().dtype, np.floating)]
            seen.append(float(np.sqrt(sum((x**2).sum() for x in d))))
        return ids

    grid.push_messages = push  # type: ignore[method-assign]
    s.start(grid=grid, initial_arrays=initial(), num_rounds=1, timeout=5)
    assert len(seen) == 3 and all(abs(n - 0.5) < 1e-5 for n in seen), seen
    assert s.history[1]["replies-used"] == 3


def test_the_mod_passes_other_messages_and_refuses_an_unencoded_reply() -> None:
    InProcessGrid(client, [])  # Flower's message ids need a run (the grid sets it)
    mod = clip_update_mod(1.0)
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    query = Message(RecordDict({P.CONFIG: ConfigRecord({"x": 1})}), dst_node_id=1,
                    message_type=MessageType.QUERY)
    answer = Message(RecordDict({P.METRICS: MetricRecord({"y": 1.0})}), reply_to=query)
    assert mod(query, ctx, lambda m, c: answer) is answer
    train = Message(RecordDict({P.ARRAYS: ArrayRecord({"w.u": Array(np.zeros((2, 2)))})}),
                    dst_node_id=1, message_type=MessageType.TRAIN)
    dense = Message(RecordDict({P.ARRAYS: ArrayRecord({"w.weight": Array(np.ones((2, 2)))})}),
                    reply_to=train)
    with pytest.raises(ValueError, match=r"'w.weight' \(2, 2\) has no sent array of the same "
                                         r"key and shape.*The reply is not sent"):
        mod(train, ctx, lambda m, c: dense)
    with pytest.raises(ValueError, match=r"clipping_norm=0\): expected a finite number S > 0"):
        clip_update_mod(0)


@pytest.mark.parametrize("settings,match", [
    ({"target_epsilon": 1e300}, r"target_epsilon=1e\+300: expected ε in \(0, 1000\]"),
    ({"noise_multiplier": 1e300}, r"noise_multiplier=1e\+300: expected σ in \[1e-06, 1e\+06\]"),
    ({"noise_multiplier": 5e-324}, r"noise_multiplier=5e-324: expected σ in \[1e-06, 1e\+06\] "
                                   r"\(below, no noise a float32 sum holds"),
    ({"noise_multiplier": 1.0, "clipping_norm": 1e300},
     r"clipping_norm=1e\+300: expected S in \[1e-06, 1e\+06\]"),
    ({"noise_multiplier": 1.0, "clipping_norm": 1e-300},
     r"clipping_norm=1e-300: expected S in \[1e-06, 1e\+06\] \(an update clipped below moves "
     r"no float32 weight"),
])
def test_absurd_dp_settings_are_refused_where_they_enter(settings: dict[str, float],
                                                         match: str) -> None:
    settings = {"clipping_norm": 1.0, **settings}
    with pytest.raises(SettingsError, match=match):
        Privacy(**settings)


def test_an_unmeetable_target_a_large_delta_and_unreachable_holders_stop_before_round_1(
) -> None:
    from fedshard.server.central_dp import CentralPrivacy

    tiny = CentralPrivacy(Privacy(target_epsilon=1e-3, clipping_norm=1.0), 10, seed=0)
    with pytest.raises(ValueError, match=r"dp-target-epsilon=0.001 cannot be met at "
                       r"dp-target-delta=1e-05 over 10 rounds at sampling rate q=0.5: Opacus's "
                       r"RDP accountant certifies no ε below about 0.1\d+ there, whatever the "
                       r"noise \(The privacy budget is too low.\)\. Raise dp-target-epsilon"):
        tiny.start_round(1, 5, 10)
    large = CentralPrivacy(Privacy(noise_multiplier=1.0, clipping_norm=1.0, target_delta=0.5),
                           10, seed=0)
    with pytest.raises(ValueError, match=r"dp-target-delta=0.5 with 3 nodes that can be "
                       r"sampled: expected δ < 1/3 = 0.333"):
        large.start_round(1, 3, 3)
    holders = CentralPrivacy(Privacy(noise_multiplier=1.0, clipping_norm=1.0,
                                     min_holders=10**9), 10, seed=0)
    with pytest.raises(ValueError, match=r"dp-min-holders=1000000000 but round 1 samples 3 "
                       r"node\(s\): no term can have 1000000000 holders"):
        holders.start_round(1, 3, 10)


def test_a_node_that_cannot_be_sampled_is_not_in_the_accountants_pool() -> None:
    """4 connected nodes, one of which fails the capability query (keep ratio 7): the other
    3 train every round, so the sampling rate is 1 (not 3/4) and ε is Opacus's at q = 1."""
    s = strategy(num_rounds=2, fraction_train=1.0, min_available_nodes=4,
                 privacy=Privacy(noise_multiplier=1.3, clipping_norm=1.0, target_delta=1e-3))
    s.start(grid=InProcessGrid(client, [{"keep-ratio": 0.5}] * 3 + [{"keep-ratio": 7.0}]),
            initial_arrays=initial(), num_rounds=2, timeout=5)
    reference = RDPAccountant()
    for server_round in (1, 2):
        reference.step(noise_multiplier=1.3, sample_rate=1.0)
        row = s.history[server_round]
        assert row["dp-sample-rate"] == 1.0
        assert row["dp-epsilon"] == pytest.approx(reference.get_epsilon(1e-3), rel=1e-12)


def test_a_resume_that_would_release_a_round_twice_is_refused(tmp_path: Path) -> None:
    """Round 3's noised model is out when its checkpoint is lost: resuming from round 2's
    (checkpoint.prev.pt) would release round 3 again, so the resume refuses, saying why."""
    data = tmp_path / "data"
    fakedata.write_fashion_mnist(data, 120, 20, np.random.default_rng(6))
    settings = {
        "dataset": "fashion-mnist", "data-dir": str(data), "num-partitions": 4,
        "min-available-nodes": 4, "batch-size": 8, "num-server-rounds": 3, "seed": 3,
        "model": "mlp", "model-width": 16, "method": "collective", "download": False,
        "keep-ratios": "0.5", "results-dir": str(tmp_path), "run-name": "dp",
        "test-max-examples": 20, "client-device": "cpu", "server-device": "cpu",
        "dp-noise-multiplier": 1.0, "dp-clipping-norm": 1.0}
    assert run_engine(RunConfig.from_mapping(settings), 4)["rounds-completed"] == 3
    (tmp_path / "dp" / "checkpoint.pt").unlink()
    with pytest.raises(ValueError, match=r"Cannot resume under central DP: .*checkpoint.prev.pt "
                       r"holds round 2, but .*metrics.jsonl records the noised aggregate of "
                       r"round 3 \(its checkpoint was lost\)"):
        run_engine(RunConfig.from_mapping({**settings, "resume": True}), 4)
