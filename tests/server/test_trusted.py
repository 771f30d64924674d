"""Trusted data (FLTrust) and the nodes' agreement record, against references written here:
the trust weights and the aggregate computed by brute force in numpy from the replies, a
negated node left out, a record that names an anti-aligned node and no honest one, a resume
that restores it, and bad input refused with a clear error."""

from __future__ import annotations

import math

import numpy as np
import pytest
from flower_grid import InProcessGrid
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from hypothesis import given, settings
from hypothesis import strategies as st
from test_strategy import LAYERS, initial, make_net, strategy

from fedshard import protocol as P
from fedshard.client import handle_query
from fedshard.server.trust_record import TrustRecord
from fedshard.server.trusted import TrustedReference

SEED = 11
REF = 7  # the stream of the reference direction (no node of the grid)


def _direction(node: int, key: str, shape: tuple[int, ...], server_round: int) -> np.ndarray:
    """A fixed pseudo-random update per (node, key, round)."""
    tag = sum(map(ord, key))
    return np.random.default_rng([SEED, server_round, tag, node]).normal(size=shape)


def _move(msg: Message, node: int, scale: float, mix: float = 0.0) -> dict[str, np.ndarray]:
    """What ``msg``'s arrays become: each float array (not ω) plus ``scale`` times the
    reference direction mixed with ``mix`` of the node's own direction; a factor key moves
    per term (its direction drawn per term index), so that nodes holding the same term agree."""
    rec, rnd = msg.content[P.ARRAYS], int(msg.content[P.CONFIG]["server-round"])
    out = {}
    for k, a in rec.items():
        x = a.numpy().astype(np.float64)
        if k.endswith((".omega", ".indices")):
            out[k] = a.numpy()
            continue
        if k.endswith((".u", ".v")):
            idx = rec[k[:-2] + ".indices"].numpy()
            ref = np.stack([_direction(REF, f"{k}{t}", x.shape[:1], rnd) for t in idx], axis=1)
            own = np.stack([_direction(node, f"{k}{t}", x.shape[:1], rnd) for t in idx], axis=1)
        else:
            ref, own = _direction(REF, k, x.shape, rnd), _direction(node, k, x.shape, rnd)
        out[k] = (x + 1e-3 * scale * ((1 - mix) * ref + mix * own)).astype(a.numpy().dtype)
    return out


def _reply(msg: Message, arrays: dict[str, np.ndarray], n: int) -> Message:
    return Message(RecordDict({P.ARRAYS: ArrayRecord({k: Array(v) for k, v in arrays.items()
                                                      if not k.endswith(".omega")}),
                               P.METRICS: MetricRecord({P.NUM_EXAMPLES: n})}), reply_to=msg)


#: node -> (scale, mix with its own direction): an honest-ish node, another, one further off
#: its own way, and a negated one; and their num-examples
NODES = {1000: (1.0, 0.3), 1001: (2.0, 0.6), 1002: (0.5, 0.9), 1003: (-1.0, 0.2)}
SIZES = {1000: 30, 1001: 20, 1002: 40, 1003: 10}


def _app(msg: Message, context: Context) -> Message:
    if msg.metadata.message_type == "query":
        return handle_query(msg, context.node_config["keep-ratio"])
    scale, mix = NODES[context.node_id]
    return _reply(msg, _move(msg, context.node_id, scale, mix), SIZES[context.node_id])


def _reference(msg: Message) -> Message:
    """The server's clean training: the reference direction at twice the base size."""
    return _reply(msg, _move(msg, REF, 2.0), 100)


def _flat(d: dict[str, np.ndarray], keys: list[str]) -> np.ndarray:
    return np.concatenate([d[k].ravel() for k in keys])


def _expected(msgs: list[Message], replies: dict[int, dict[str, np.ndarray]], layers: list[str]
              ) -> tuple[dict[str, np.ndarray], dict[int, float]]:
    """Brute force: per node the cosine of its update with the reference's on its own
    message (every float array it returns), trust ReLU(cos), the update rescaled to the
    reference's norm, weight trust × num-examples; then each term's u and v and each dense
    entry averaged over the nodes holding it with those weights, W = Σ u vᵀ."""
    sent = {m.metadata.dst_node_id: {k: a.numpy().astype(np.float64)
                                     for k, a in m.content[P.ARRAYS].items()} for m in msgs}
    ref = {m.metadata.dst_node_id: _move(m, REF, 2.0) for m in msgs}
    trust, moved = {}, {}
    for node, got in replies.items():
        keys = sorted(k for k in got if not k.endswith((".omega", ".indices")))
        g = _flat({k: got[k].astype(np.float64) - sent[node][k] for k in keys}, keys)
        g0 = _flat({k: ref[node][k].astype(np.float64) - sent[node][k] for k in keys}, keys)
        c = float(g @ g0 / (np.linalg.norm(g) * np.linalg.norm(g0)))
        trust[node] = max(0.0, c)
        s = np.linalg.norm(g0) / np.linalg.norm(g)
        moved[node] = {k: sent[node][k] + s * (got[k].astype(np.float64) - sent[node][k])
                       for k in keys}
    w = {n: trust[n] * SIZES[n] for n in replies}
    out = {}
    used = [n for n in replies if w[n] > 0]
    for key in moved[used[0]]:
        if key.endswith((".u", ".v")):
            continue
        out[key] = sum(w[n] * moved[n][key] for n in used) / sum(w[n] for n in used)
    arrays = initial()
    for layer in layers:
        base = arrays[f"{layer}.weight"].numpy().astype(np.float64)
        w2 = base.reshape(base.shape[0], -1)
        U, lam, Vt = np.linalg.svd(w2, full_matrices=False)
        num_u, num_v = np.zeros((w2.shape[0], lam.size)), np.zeros((w2.shape[1], lam.size))
        den = np.zeros(lam.size)
        for n in used:
            idx = sent[n][f"{layer}.indices"].astype(np.int64)
            num_u[:, idx] += w[n] * moved[n][f"{layer}.u"]
            num_v[:, idx] += w[n] * moved[n][f"{layer}.v"]
            den[idx] += w[n]
        expect = np.zeros_like(w2)
        for i in range(lam.size):
            expect += (np.outer(num_u[:, i] / den[i], num_v[:, i] / den[i]) if den[i] > 0
                       else lam[i] * np.outer(U[:, i], Vt[i]))
        out[f"{layer}.weight"] = expect.reshape(base.shape)
    return out, trust


def _round(method: str, ratios: list[float], **kw: object):
    grid = InProcessGrid(_app, [{"keep-ratio": r} for r in ratios])
    s = strategy(method=method, align_factors=False, max_update_spread=0.0,
                 max_weight_ratio=0.0, trusted=TrustedReference(_reference), **kw)
    msgs = list(s.configure_train(1, initial(), ConfigRecord(), grid))
    replies = list(grid.send_and_receive(msgs))
    got = {r.metadata.src_node_id: {k: a.numpy() for k, a in r.content[P.ARRAYS].items()}
           for r in replies}
    new, _ = s.aggregate_train(1, replies)
    return s, msgs, got, new


@pytest.mark.parametrize(("method", "ratios", "layers"), [
    ("none", [1.0] * 4, []),  # dense replies (FedAvg)
    ("unbiased", [0.5, 0.5, 1.0, 0.5], LAYERS),  # factor shards
])
def test_fltrust_aggregate_matches_a_brute_force_one(method, ratios, layers) -> None:
    s, msgs, got, new = _round(method, ratios)
    expect, trust = _expected(msgs, got, layers)
    assert new is not None
    assert trust[1003] == 0.0 and all(trust[n] > 0 for n in (1000, 1001, 1002))
    for key, value in expect.items():
        np.testing.assert_allclose(new[key].numpy(), value, rtol=2e-4, atol=1e-6,
                                   err_msg=key)
    assert s.history[1]["trust-zero"] == 1.0  # the negated node: weight 0, left out
    assert s.history[1]["replies-used"] == 3
    assert math.isclose(s.history[1]["trust-mean"], np.mean(list(trust.values())), rel_tol=1e-6)


def _rounds(s, grid, k: int) -> None:
    arrays = initial()
    for rnd in range(1, k + 1):
        msgs = list(s.configure_train(rnd, arrays, ConfigRecord(), grid))
        new, _ = s.aggregate_train(rnd, grid.send_and_receive(msgs))
        arrays = new if new is not None else arrays


@pytest.mark.parametrize("trusted", [True, False])
def test_the_record_names_the_anti_aligned_node_and_no_honest_one(trusted, caplog) -> None:
    grid = InProcessGrid(_app, [{"keep-ratio": 0.5}] * 4)
    s = strategy(method="collective", num_rounds=6,
                 trusted=TrustedReference(_reference) if trusted else None)
    _rounds(s, grid, 5)
    named = {int(m.split("node ")[1].split()[0]) for m in caplog.messages if " is distrusted" in m}
    assert named == {1003}
    assert "median -" in next(m for m in caplog.messages if "node 1003 is distrusted" in m)
    assert "Round 3: node 1003" in caplog.text  # named once it has 3 rounds of record
    assert s.trust.record.level(1003) < 0 < min(s.trust.record.level(n) for n in (1000, 1001))


def _sampled(s, grid, rounds: range) -> dict[int, set[int]]:
    """Train ``rounds`` (from the initial model): round -> the nodes sent a train message."""
    arrays, sent = initial(), {}
    for rnd in rounds:
        msgs = list(s.configure_train(rnd, arrays, ConfigRecord(), grid))
        sent[rnd] = {m.metadata.dst_node_id for m in msgs}
        new, _ = s.aggregate_train(rnd, grid.send_and_receive(msgs))
        arrays = new if new is not None else arrays
    return sent


def test_exclude_distrusted_leaves_the_named_node_out_of_later_rounds(caplog) -> None:
    grid = InProcessGrid(_app, [{"keep-ratio": 0.5}] * 4)
    s = strategy(method="collective", num_rounds=6, exclude_distrusted=True)
    sent = _sampled(s, grid, range(1, 6))
    assert s.trust.excluded == {1003: 3}  # named in round 3
    assert all(1003 in sent[r] for r in (1, 2, 3))
    assert sent[4] == sent[5] == set(NODES) - {1003}  # not sent training, not only ignored
    assert all("distrusted-excluded" not in s.history[r] for r in range(1, 6))
    why = [m for m in caplog.messages if "left out of training" in m]
    assert len(why) == 1 and why[0].startswith("Round 4: node 1003")  # said once, with why
    assert "named distrusted in round 3" in why[0] and "exclude-distrusted is on" in why[0]
    assert "fewer than" not in caplog.text  # three nodes are enough for this round


def test_exclusion_that_leaves_too_few_nodes_says_so_every_round(caplog) -> None:
    grid = InProcessGrid(_app, [{"keep-ratio": 0.5}] * 4)
    s = strategy(method="collective", num_rounds=6, exclude_distrusted=True,
                 min_train_nodes=4, min_available_nodes=4)
    sent = _sampled(s, grid, range(1, 6))
    assert sent[5] == set(NODES) - {1003}
    short = [m for m in caplog.messages if "fewer than the 4 the round needs" in m]
    assert [m.split(":")[0] for m in short] == ["Round 4", "Round 5"]
    assert "leaves 3 of the 4 connected nodes to train" in short[0]
    assert "this round trains 3" in short[0] and "exclude-distrusted = false" in short[0]


def test_a_round_that_leaves_every_node_out_stops_the_run_with_an_error(caplog) -> None:
    """Every connected node left out by exclude-distrusted: no round could train again, so the
    round stops the run (an ERROR saying which nodes, why and what to do), not a run of
    empty rounds to the end."""
    from fedshard.server.callbacks import StopRun

    grid = InProcessGrid(_app, [{"keep-ratio": 0.5}] * 4)
    s = strategy(method="collective", num_rounds=6, exclude_distrusted=True)
    s.resume(3, {}, {}, None, {n: 3 for n in NODES})
    with pytest.raises(StopRun, match=r"every one of the 4 connected nodes is left out of "
                       r"training .*named distrusted in round 3.* the run stops here") as err:
        s.configure_train(1, initial(), ConfigRecord(), grid)
    assert err.value.logged
    assert "exclude-distrusted = false" in str(err.value)
    assert any(r.levelname == "ERROR" and "no round can train again" in r.getMessage()
               for r in caplog.records)


def test_a_resumed_run_keeps_the_excluded_node_out_from_its_first_round(tmp_path) -> None:
    """Resumed from the app's checkpoint after round 3 (the round that named node 1003), the
    node is not sent round 4's training message, as in the run that was not interrupted."""
    from fedshard.app.checkpoint import Checkpoint

    grid = InProcessGrid(_app, [{"keep-ratio": 0.5}] * 4)
    s = strategy(method="collective", num_rounds=6, exclude_distrusted=True)
    _sampled(s, grid, range(1, 4))
    arrays = {k: v.numpy() for k, v in initial().items()}
    Checkpoint(3, arrays, {}, s.capability_table(), s.history, trust=s.trust_state(),
               excluded=dict(s.trust.excluded)).save(tmp_path)
    saved = Checkpoint.load(tmp_path)
    assert saved.excluded == {1003: 3}
    t = strategy(method="collective", num_rounds=6, exclude_distrusted=True)
    t.resume(3, saved.capabilities, saved.history, saved.trust, saved.excluded)
    msgs = list(t.configure_train(1, initial(), ConfigRecord(), grid))  # the run's round 4
    assert {m.metadata.dst_node_id for m in msgs} == set(NODES) - {1003}
    for bad in ({1003: 0}, {1003: "3"}, [1003]):
        with pytest.raises(ValueError, match="expected node ids mapped to the round"):
            t.resume(3, saved.capabilities, saved.history, saved.trust, bad)


def test_resume_restores_the_record() -> None:
    grid = InProcessGrid(_app, [{"keep-ratio": 0.5}] * 4)
    s = strategy(method="collective", num_rounds=6)
    _rounds(s, grid, 3)
    state = s.trust_state()
    assert set(state) == set(NODES) and all(len(v) == 3 for v in state.values())
    t = strategy(method="collective", num_rounds=6)
    t.resume(3, s.capability_table(), s.history, state)
    assert t.trust_state() == state and t.trust.record.level(1003) == s.trust.record.level(1003)
    with pytest.raises(ValueError, match="expected node ids mapped to lists of cosines"):
        t.resume(3, s.capability_table(), s.history, {1000: [2.0]})


def test_the_record_is_bounded() -> None:
    r = TrustRecord()
    for rnd in range(13):
        r.add(1, 0.5 - rnd)  # beyond the window: the oldest go
    assert len(r.cosines[1]) == 10 and r.level(1) == pytest.approx(np.median([0.5 - k for k in
                                                                            range(3, 13)]))
    assert r.level(2) is None


@pytest.mark.parametrize(("row", "named"), [
    # honest, data unlike the trusted set's: the last rounds of a cosine schedule scatter
    ([0.161, 0.238, 0.074, 0.082, 0.022, 0.055, 0.005, 0.113, -0.080, -0.018, -0.063], False),
    ([0.004, -0.006, 0.002, -0.001, 0.003], True),  # noise: about 0, round after round
    ([0.0, 0.0, 0.0], True),  # zero updates
    ([-0.3, -0.25, 0.1, -0.4, -0.2], True),  # negated
    ([-0.3, -0.25], False),  # fewer than 3 rounds
])
def test_the_record_names_a_node_below_over_its_last_ten_rounds(row, named) -> None:
    r = TrustRecord()
    for c in row:
        r.add(1, c)
    assert r.distrusts(1, 0.02) is named


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-1, 1), min_size=0, max_size=14), st.floats(-1, 1))
def test_a_node_is_named_by_the_median_of_its_last_ten_rounds(row, below) -> None:
    """Brute force over the rounds a node took part in: its last 10, at least 3."""
    r = TrustRecord()
    for c in row:
        r.add(1, c)
    kept = row[-10:]
    assert r.distrusts(1, below) is (len(kept) >= 3 and float(np.median(kept)) < below)


def test_bad_trusted_input_is_refused_clearly() -> None:
    with pytest.raises(ValueError, match="trusted data set is empty"):
        TrustedReference.from_data([], model=make_net())
    with pytest.raises(ValueError, match=r"expected model= .* or family="):
        TrustedReference.from_data([1, 2])
    with pytest.raises(TypeError, match="expected a callable taking a train Message"):
        TrustedReference("not a function")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="expected a TrustedReference"):
        strategy(trusted=_reference)

    def wrong_shape(msg: Message) -> Message:
        arrays = {k: a.numpy() for k, a in msg.content[P.ARRAYS].items()}
        arrays["head.bias"] = np.zeros(7, np.float32)
        return _reply(msg, arrays, 1)

    grid = InProcessGrid(_app, [{"keep-ratio": 0.5}] * 4)
    s = strategy(method="collective", trusted=TrustedReference(wrong_shape))
    msgs = list(s.configure_train(1, initial(), ConfigRecord(), grid))
    with pytest.raises(ValueError, match=r"head.bias \(7,\), expected \(3,\)"):
        s.aggregate_train(1, grid.send_and_receive(msgs))


def test_a_real_reference_trains_as_a_node_does() -> None:
    """from_data: fedshard's own node loop on the trusted examples; honest nodes on the same
    task agree with it (positive cosines)."""
    from test_strategy import grid_with, local_data

    data = local_data(99)
    s = strategy(method="collective", trusted=TrustedReference.from_data(data, model=make_net()))
    grid = grid_with([0.5, 0.5, 1.0])
    msgs = list(s.configure_train(1, initial(), ConfigRecord(), grid))
    new, _ = s.aggregate_train(1, grid.send_and_receive(msgs))
    assert new is not None and "trust-mean" in s.history[1]


def test_the_held_out_set_is_no_nodes_data(tmp_path) -> None:
    """The app's trusted set: drawn from the training set with its own stream, and kept from
    every partition (the partitions and the held-out set cover the training set once)."""
    import torch
    from fakedata import write_fashion_mnist

    from fedshard.data import held_out_indices, load_held_out, load_partition

    images = write_fashion_mnist(tmp_path, 200, 10, np.random.default_rng(3))["train"][0]
    held = load_held_out("fashion-mnist", 40, data_dir=tmp_path, seed=5)
    parts = [load_partition("fashion-mnist", i, 4, data_dir=tmp_path, seed=5, held_out=40)
             for i in range(4)]
    assert len(held) == 40 and sum(len(p) for p in parts) == 160
    idx = held_out_indices(200, 40, 5)
    assert np.array_equal(idx, held_out_indices(200, 40, 5))
    assert not np.array_equal(idx, held_out_indices(200, 40, 6))
    seen = {bytes(x.numpy()) for p in parts for x in p._images}  # type: ignore[attr-defined]
    assert all(bytes(torch.tensor(images[i]).numpy()) not in seen for i in idx)
    with pytest.raises(ValueError, match="held_out=150: expected 1 to 100 examples"):
        held_out_indices(200, 150, 0)


@pytest.mark.parametrize(("keys", "message"), [
    ({"trusted-data": -1}, "trusted-data=-1: expected 0 .off. or the number"),
    ({"trusted-data-dir": "/no/such/folder"}, "trusted-data-dir='/no/such/folder': no such"),
    ({"trusted-data": 100, "trusted-data-dir": "/tmp"}, "expected one of them"),
    ({"distrust-below": 2.0}, "expected a cosine in .-1, 1."),
])
def test_trusted_run_config_is_checked_where_it_enters(keys, message) -> None:
    from fedshard.app.config import ConfigError, RunConfig

    with pytest.raises(ConfigError, match=message):
        RunConfig.from_mapping(keys)


def test_width_slicing_weighs_each_narrow_reply_against_its_own_reference() -> None:
    """Width slicing: the reference trains each node's narrow model (its message, fedshard's
    node loop); honest nodes on the reference's task agree with it, a negated one gets 0."""
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    from fedshard import WidthSlicing
    from fedshard.client import handle_node_train
    from fedshard.settings import Cohort, LocalTraining, NodePolicy, Sharding, Slicing
    from fedshard.width.slicing import WidthFamily

    class Net(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(6, width), nn.Linear(width, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.relu(self.a(x)))

    family = WidthFamily(Net, 8)
    teacher = torch.Generator().manual_seed(0)
    w = torch.randn(6, 3, generator=teacher)

    def data(seed: int) -> TensorDataset:
        x = torch.randn(64, 6, generator=torch.Generator().manual_seed(seed))
        return TensorDataset(x, (x @ w).argmax(1))

    def app(msg: Message, context: Context) -> Message:
        if msg.metadata.message_type == "query":
            return handle_query(msg, context.node_config["keep-ratio"])
        reply = handle_node_train(msg, data(context.node_id), family=family)
        if context.node_id == 1002:  # negated: sent - (trained - sent)
            sent, rec = msg.content[P.ARRAYS], reply.content[P.ARRAYS]
            for k in list(rec.keys()):
                rec[k] = Array(2 * sent[k].numpy() - rec[k].numpy())
        return reply

    s = WidthSlicing(family=family, slicing=Slicing(width_match="keep-ratio"),
                     sharding=Sharding(method="heterofl"), num_rounds=2, seed=3,
                     training=LocalTraining(lr=0.1),
                     nodes=NodePolicy(query_timeout=5, node_wait_timeout=5),
                     cohort=Cohort(fraction_evaluate=0.0, min_train_nodes=1,
                                   min_evaluate_nodes=1, min_available_nodes=1),
                     trusted=TrustedReference.from_data(data(99), family=family))
    grid = InProcessGrid(app, [{"keep-ratio": r} for r in (1.0, 0.5, 1.0)])
    arrays = ArrayRecord({k: v.detach().clone() for k, v in family(8).state_dict().items()})
    msgs = list(s.configure_train(1, arrays, ConfigRecord(), grid))
    new, _ = s.aggregate_train(1, grid.send_and_receive(msgs))
    assert new is not None
    assert s.history[1]["trust-zero"] == 1.0 and s.history[1]["replies-used"] == 2
    cos = {n: r[-1] for n, r in s.trust_state().items()}
    assert cos[1002] < 0 < min(cos[1000], cos[1001])


def test_the_checkpoint_keeps_the_record(tmp_path) -> None:
    """The app's checkpoint holds the record (a file without one reads as none), and a
    record of other values is refused with the file named."""
    import torch

    from fedshard.app.checkpoint import Checkpoint, CheckpointError

    arrays = {"w": np.ones(2, np.float32)}
    Checkpoint(3, arrays, {}, trust={1000: [0.5, -0.25]}).save(tmp_path)
    assert Checkpoint.load(tmp_path).trust == {1000: [0.5, -0.25]}
    Checkpoint(4, arrays, {}).save(tmp_path)
    assert Checkpoint.load(tmp_path).trust == {}
    payload = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    payload["trust"] = {1000: [3.0]}
    torch.save(payload, tmp_path / "checkpoint.pt")
    with pytest.raises(CheckpointError, match="'trust' must map node ids to lists of cosines"):
        Checkpoint.load(tmp_path)
    payload["trust"], payload["excluded"] = {}, {1000: 0}
    torch.save(payload, tmp_path / "checkpoint.pt")
    with pytest.raises(CheckpointError, match="'excluded' must map node ids to the round"):
        Checkpoint.load(tmp_path)


@pytest.mark.parametrize(("dtype", "tol"), [(np.float64, 1e-12), (np.float32, 2e-6)])
def test_aggregate_cosines_match_a_per_term_brute_force(dtype: type, tol: float) -> None:
    """Without trusted data each node's cosine is with the other nodes' weighted mean in its
    own coordinates: per factor column the mean over the other nodes holding that term, per
    dense entry over the other nodes sent that shape (zero where there is none); checked
    against a loop over terms and holders in float64, with terms sent in sorted order and
    not. A float64 model's cosines are float64's to 1e-12; a float32 model's are taken in
    float32, to 2e-6 of them."""
    from types import SimpleNamespace

    from fedshard.server.trust_record import _aggregate_cosines

    rng = np.random.default_rng([58, 1])
    N = 12
    for _ in range(30):
        out, updates, sent = [], [], {}
        for node in range(int(rng.integers(1, 7))):
            idx = np.sort(rng.choice(N, size=int(rng.integers(0, 5)), replace=False))
            if rng.random() < 0.3:  # terms in another order than the plan's sorted one
                idx = rng.permutation(idx)
            before = {"l.u": rng.normal(size=(4, idx.size)).astype(dtype),
                      "l.v": rng.normal(size=(3, idx.size)).astype(dtype),
                      "b": rng.normal(size=(5,) if rng.random() < 0.5 else (2, 2)
                                      ).astype(dtype),
                      "l.indices": idx.astype(np.int64)}  # not floating: not an update
            got = {k: (v + rng.normal(size=v.shape)).astype(v.dtype) if k != "l.indices"
                   else v for k, v in before.items()}
            sent[node] = SimpleNamespace(indices={"l": idx}, values=before)
            out.append(SimpleNamespace(node=node, values=got,
                                       weight=float(rng.choice([0.0, 0.1, 0.2, 3.0]))))
            # the update, as the brute force below takes it: float64 of each side, subtracted
            updates.append({k: got[k].astype(np.float64) - before[k].astype(np.float64)
                            for k in ("l.u", "l.v", "b")})
        expected = []
        for r, g in zip(out, updates, strict=True):
            x, y = [], []
            for key, value in g.items():
                if key == "b":
                    holders = [(o.weight, u[key]) for o, u in zip(out, updates, strict=True)
                               if u[key].shape == value.shape and o is not r]
                    total = sum(w for w, _ in holders)
                    mean = (sum(w * v for w, v in holders) / total if total > 0
                            else np.zeros_like(value))
                    x.append(value.ravel())
                    y.append(np.ravel(mean))
                    continue
                for j, term in enumerate(sent[r.node].indices["l"]):
                    holders = [(o.weight, u[key][:, list(sent[o.node].indices["l"]).index(term)])
                               for o, u in zip(out, updates, strict=True)
                               if term in sent[o.node].indices["l"] and o is not r]
                    total = sum(w for w, _ in holders)
                    x.append(value[:, j])
                    y.append(sum(w * v for w, v in holders) / total if total > 0
                             else np.zeros(value.shape[0]))
            a, b = np.concatenate(x), np.concatenate(y)
            na, nb = np.linalg.norm(a), np.linalg.norm(b)
            expected.append(0.0 if na == 0 or nb == 0 else float(a @ b / (na * nb)))
        cosines = _aggregate_cosines(out, sent)  # type: ignore[arg-type]
        np.testing.assert_allclose(cosines, expected, rtol=tol, atol=tol)


def test_a_noise_or_negated_node_is_not_aligned_with_an_aggregate_of_itself() -> None:
    """Three honest nodes share a direction; a node sending noise or the negated direction
    gets a cosine near 0 or below 0 with the others' aggregate, though with a mean over a
    few holders that counted it the cosine would come out positive."""
    from types import SimpleNamespace

    from fedshard.server.trust_record import _aggregate_cosines

    rng = np.random.default_rng([58, 2])
    common = rng.normal(size=400)
    honest = [{"w": common + 0.5 * rng.normal(size=400)} for _ in range(3)]
    noise = {"w": rng.normal(size=400) * float(np.linalg.norm(honest[0]["w"])) / 20}
    negated = {"w": -(common + 0.5 * rng.normal(size=400))}  # a fourth node's, negated
    sent = {n: SimpleNamespace(indices={}, values={"w": np.zeros(400)}) for n in range(4)}
    for bad, below in ((noise, 0.15), (negated, -0.2)):
        out = [SimpleNamespace(node=n, weight=1.0, values=u)
               for n, u in enumerate([*honest, bad])]
        cosines = _aggregate_cosines(out, sent)  # type: ignore[arg-type]
        assert cosines[3] < below, cosines
        assert min(cosines[:3]) > 0.2, cosines


@pytest.mark.parametrize(("dtype", "ratio", "tol"),
                         [(np.float64, 1e4, 1e-12), (np.float32, 1e3, 2e-5)])
def test_a_node_that_is_nearly_all_of_the_sum_gets_its_cosine_from_the_others(
        dtype: type, ratio: float, tol: float) -> None:
    """One node whose update is ``ratio`` times the others' is almost the whole sum S: its
    others' sum ``S − w x`` is tiny beside ``S·S`` and ``w² x·x``, and taking ``d·d`` from
    those products would cancel most of its digits (an error of 3e-10 in float64 at 1e4,
    1e-4 in float32 at 1e3). Its cosine with the others is still the float64 brute force's
    to 1e-12 for a float64 model, 2e-5 for a float32 one (``d`` is formed there), as are
    the other nodes'."""
    from types import SimpleNamespace

    from fedshard.server.trust_record import _aggregate_cosines

    rng = np.random.default_rng([56, 4])
    before = np.zeros(300, dtype=dtype)
    updates = [rng.normal(size=300) * ratio, rng.normal(size=300), rng.normal(size=300)]
    sent = {n: SimpleNamespace(indices={}, values={"w": before}) for n in range(3)}
    out = [SimpleNamespace(node=n, weight=1.0, values={"w": u.astype(dtype)})
           for n, u in enumerate(updates)]
    got = _aggregate_cosines(out, sent)  # type: ignore[arg-type]
    xs = [u.astype(dtype).astype(np.float64) for u in updates]
    for i, x in enumerate(xs):
        others = sum(y for j, y in enumerate(xs) if j != i)
        want = float(x @ others / (np.linalg.norm(x) * np.linalg.norm(others)))
        assert got[i] == pytest.approx(want, rel=tol, abs=tol), (i, got[i], want)


def test_a_float32_round_whose_products_overflow_is_taken_in_float64() -> None:
    """Updates of 1e25 in a float32 model (their squares are beyond float32): the cosines are
    still the float64 brute force's, to 1e-9, with no overflow warning."""
    import warnings
    from types import SimpleNamespace

    from fedshard.server.trust_record import _aggregate_cosines

    rng = np.random.default_rng([56, 5])
    before = np.zeros(200, dtype=np.float32)
    common = rng.normal(size=200)
    updates = [(common + rng.normal(size=200)) * 1e25 for _ in range(4)]
    sent = {n: SimpleNamespace(indices={}, values={"w": before}) for n in range(4)}
    out = [SimpleNamespace(node=n, weight=1.0, values={"w": u.astype(np.float32)})
           for n, u in enumerate(updates)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _aggregate_cosines(out, sent)  # type: ignore[arg-type]
    xs = [u.astype(np.float32).astype(np.float64) for u in updates]
    for i, x in enumerate(xs):
        others = sum(y for j, y in enumerate(xs) if j != i)
        want = float(x @ others / (np.linalg.norm(x) * np.linalg.norm(others)))
        assert got[i] == pytest.approx(want, rel=1e-9), (i, got[i], want)
