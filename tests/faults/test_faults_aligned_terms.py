"""Sign- and scale-aware aggregation of factor terms: each rule against an independent
reference (dense products, brute-force distances, a loop-by-loop centred clip, a per-term mean
and rebuild written out by hand), and the round-level wiring (logged, counted, honest replies
untouched)."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
from fault_setup import grid, initial, one_round, scale_arrays, set_metric, strategy
from flwr.app import Array, Message

from fedshard import protocol as P
from fedshard.app.config import ConfigError, RunConfig
from fedshard.settings import ReplyPolicy, SettingsError
from fedshard.spectral.aggregate import (
    TermUpdate,
    align_factors,
    dense_equivalents,
    relative_change,
    shrink_change,
    spread_scales,
    squared_norm,
)
from fedshard.spectral.decompose import layer_spectrum


@pytest.fixture
def flower_logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    logging.getLogger("flwr").addHandler(caplog.handler)
    yield caplog
    logging.getLogger("flwr").removeHandler(caplog.handler)


def _sent(rng: np.random.Generator, c_out: int, c_in: int, n: int) -> tuple[np.ndarray, ...]:
    """Balanced terms as the server sends them: ‖u_i‖ = ‖v_i‖ = √λ_i."""
    w = rng.normal(size=(c_out, c_in))
    u, lam, vt = np.linalg.svd(w, full_matrices=False)
    return u[:, :n] * np.sqrt(lam[:n]), vt[:n].T * np.sqrt(lam[:n])


def test_aligned_factors_keep_every_product_and_take_the_nearest_sign() -> None:
    rng = np.random.default_rng([31, 3])
    su, sv = _sent(rng, 7, 9, 6)
    nu, nv = su + 0.1 * rng.normal(size=su.shape), sv + 0.1 * rng.normal(size=sv.shape)
    sign = np.array([-1.0, 1.0, -1.0, 1.0, -1.0, 1.0])
    gauge = np.array([1.0, 10.0, 0.05, 1.0, 30.0, 1.5])  # 1.5: inside the 4-fold balance band
    u, v = nu * sign * gauge, nv * sign / gauge
    a = align_factors(su, sv, u, v)
    # the reference: the attacker's own dense product, column by column and summed
    for j in range(6):
        np.testing.assert_allclose(np.outer(a.u[:, j], a.v[:, j]), np.outer(u[:, j], v[:, j]),
                                   rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(a.u @ a.v.T, u @ v.T, rtol=1e-12, atol=1e-12)
    assert (a.flipped, a.rebalanced) == (3, 3)
    for j in range(6):
        # brute force over the two signs: the kept one is the nearer to the sent term
        def dist(s: float, j: int = j) -> float:
            return float(np.sum((s * a.u[:, j] - su[:, j]) ** 2)
                         + np.sum((s * a.v[:, j] - sv[:, j]) ** 2))
        assert dist(1.0) <= dist(-1.0)
        growth_u = np.linalg.norm(a.u[:, j]) / np.linalg.norm(su[:, j])
        growth_v = np.linalg.norm(a.v[:, j]) / np.linalg.norm(sv[:, j])
        if gauge[j] in (10.0, 0.05, 30.0):  # re-balanced: both factors grow alike
            assert growth_u / growth_v == pytest.approx(1.0, rel=1e-12)
        else:  # left as returned, up to the sign
            np.testing.assert_array_equal(a.u[:, j], nu[:, j] * gauge[j])
    # a sign flip alone is undone exactly
    flipped = align_factors(su, sv, -nu, -nv)
    np.testing.assert_array_equal(flipped.u, nu)
    np.testing.assert_array_equal(flipped.v, nv)


def test_an_honest_reply_is_returned_as_it_came() -> None:
    rng = np.random.default_rng([31, 4])
    su, sv = _sent(rng, 8, 5, 5)
    u = (su + 0.3 * rng.normal(size=su.shape)).astype(np.float32)
    v = (sv + 0.3 * rng.normal(size=sv.shape)).astype(np.float32)
    a = align_factors(su.astype(np.float32), sv.astype(np.float32), u, v)
    assert a.u is u and a.v is v and (a.flipped, a.rebalanced) == (0, 0)


def _centred_clip_brute_force(sent: list[list[np.ndarray]], got: list[list[np.ndarray]],
                              kappa: float) -> list[list[np.ndarray]]:
    """Centred clipping written out entry by entry: δ_k = ‖got_k − sent_k‖ / ‖sent_k‖ over
    the client's arrays together, τ = κ·median δ, got_k ← sent_k + min(1, τ/δ_k)(got_k − sent_k)."""
    deltas = []
    for s_arrs, g_arrs in zip(sent, got, strict=True):
        num = den = 0.0
        for s, g in zip(s_arrs, g_arrs, strict=True):
            for a, b in zip(s.ravel().tolist(), g.ravel().tolist(), strict=True):
                num += (b - a) ** 2
                den += a * a
        deltas.append(math.sqrt(num / den))
    ordered, m = sorted(deltas), len(deltas)
    median = ordered[m // 2] if m % 2 else (ordered[m // 2 - 1] + ordered[m // 2]) / 2
    out = []
    for d, s_arrs, g_arrs in zip(deltas, sent, got, strict=True):
        f = min(1.0, kappa * median / d)
        out.append([np.array([a + f * (b - a) for a, b in zip(s.ravel().tolist(),
                                                                 g.ravel().tolist(),
                                                                 strict=True)]).reshape(s.shape)
                    for s, g in zip(s_arrs, g_arrs, strict=True)])
    return out


@pytest.mark.parametrize("n_clients", [3, 4, 6])
def test_centred_clip_matches_a_brute_force_one(n_clients: int) -> None:
    rng = np.random.default_rng([31, 5, n_clients])
    sent = [[rng.normal(size=(4, 3)), rng.normal(size=(5, 3))] for _ in range(n_clients)]
    got = [[s + 0.1 * rng.normal(size=s.shape) for s in arrs] for arrs in sent]
    got[0] = [s * 40.0 for s in sent[0]]            # an outlier
    got[-1] = [s + 0.9 * rng.normal(size=s.shape) for s in sent[-1]]  # a large honest one
    kappa = 3.0
    changes = [relative_change(s, g) for s, g in zip(sent, got, strict=True)]
    scales = spread_scales(changes, kappa)
    want = _centred_clip_brute_force(sent, got, kappa)
    for k in range(n_clients):
        for s, g, w in zip(sent[k], got[k], want[k], strict=True):
            np.testing.assert_allclose(shrink_change(s, g, float(scales[k])), w, rtol=1e-12)
    assert scales[0] < 1.0
    # fewer than three clients: no median to trust, nobody is clipped
    assert spread_scales(changes[:2], kappa).tolist() == [1.0, 1.0]


def test_the_dense_floor_of_the_relative_change() -> None:
    zero, moved = np.zeros((2, 8)), np.full((2, 8), 0.05)
    # ‖Δ‖ = 0.05·4 = 0.2, reference floored at 0.1·√16 = 0.4
    assert relative_change([zero], [moved], dense=True) == pytest.approx(0.5)
    assert relative_change([zero], [moved]) == math.inf


def test_the_relative_change_is_the_norms_ratio_with_or_without_a_given_sent_norm() -> None:
    """Against float64 norms: float64 arrays to 1e-13; with a float32 array among them (taken
    in float32, its squares summed pairwise) to 1e-6."""
    rng = np.random.default_rng([31, 7])
    sent = [rng.normal(size=(30, 4)).astype(np.float32), rng.normal(size=(9, 4))]
    got = [(s + 0.3 * rng.normal(size=s.shape)).astype(s.dtype) for s in sent]

    def want(sent: list[np.ndarray], got: list[np.ndarray]) -> float:
        return math.sqrt(sum(np.linalg.norm(g.astype(np.float64) - s) ** 2
                             for s, g in zip(sent, got, strict=True))
                         / sum(np.linalg.norm(s.astype(np.float64)) ** 2 for s in sent))

    assert squared_norm(sent) == pytest.approx(
        sum(float(np.sum(s.astype(np.float64) ** 2)) for s in sent), rel=1e-14)
    assert relative_change(sent[1:], got[1:]) == pytest.approx(want(sent[1:], got[1:]),
                                                               rel=1e-13)
    assert relative_change(sent, got) == pytest.approx(want(sent, got), rel=1e-6)
    assert relative_change(sent, got, sent_sq=squared_norm(sent)) == relative_change(sent, got)


def test_a_float32_change_whose_squares_overflow_is_taken_in_float64() -> None:
    """A float32 change of 1e30 (its square is beyond float32) is still a finite ratio, the
    float64 one."""
    sent = np.ones((3, 4), dtype=np.float32)
    got = sent.copy()
    got[1, 2] = 1e30
    want = float(np.float32(1e30)) - 1.0
    assert relative_change([sent], [got]) == pytest.approx(want / math.sqrt(12), rel=1e-12)


def _mean_and_rebuild(sent: dict[int, Message], replies: dict[int, Message],
                      before: np.ndarray, layer: str) -> np.ndarray:
    """The weighted per-term mean and W = W_old − Σ_held u_i v_iᵀ + Σ_held ū_i v̄_iᵀ,
    written out term by term from the messages."""
    sums: dict[int, list] = {}
    sent_terms: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for node, reply in replies.items():
        arrays, w = reply.content[P.ARRAYS], float(reply.content[P.METRICS]["num-examples"])
        idx = arrays[f"{layer}.indices"].numpy()
        su, sv = (sent[node].content[P.ARRAYS][f"{layer}.{p}"].numpy() for p in ("u", "v"))
        u, v = arrays[f"{layer}.u"].numpy(), arrays[f"{layer}.v"].numpy()
        for j, term in enumerate(idx.tolist()):
            sent_terms[term] = (su[:, j].astype(np.float64), sv[:, j].astype(np.float64))
            acc = sums.setdefault(term, [0.0, 0.0, 0.0])
            acc[0] = acc[0] + w * u[:, j].astype(np.float64)
            acc[1] = acc[1] + w * v[:, j].astype(np.float64)
            acc[2] += w
    w_new = before.astype(np.float64).copy()
    for term, (su, sv) in sent_terms.items():
        mu, mv, total = sums[term]
        w_new += np.outer(mu / total, mv / total) - np.outer(su, sv)
    return w_new


def test_a_round_aligns_and_clips_the_attacker_and_leaves_the_honest_replies(
    flower_logs: pytest.LogCaptureFixture,
) -> None:
    g = grid()
    seen: dict[int, Message] = {}

    def keep(node: int, attack=None):
        def hook(reply: Message) -> Message:
            seen[node] = attack(reply) if attack is not None else reply
            return seen[node]
        return hook

    # node 1000 flips and inflates its factors 40-fold; no max-update-ratio, so only the new
    # rules act on it
    g.tamper.update({1000: keep(1000, scale_arrays(-40.0, lambda k: k.endswith((".u", ".v")))),
                     1001: keep(1001), 1002: keep(1002)})
    s = strategy(max_update_ratio=0.0, max_update_spread=5.0)
    before = initial()["hidden.weight"].numpy()
    new, row = one_round(s, g)
    assert new is not None and row["replies-used"] == 3.0
    assert row["re-signed-terms"] == 5.0 and row["clipped-update-spread"] == 1.0
    assert row["update-spread-held"] == 1.0
    assert "node 1000 returned terms in another sign or balance" in flower_logs.text
    assert "node 1000 changed more than max-update-spread=5" in flower_logs.text
    # each node holds 24 examples: its change is out of line with what 24 examples explain,
    # so it is held to the median, and no hint about data-rich nodes
    assert ("further than the data it is weighted for explains (24 examples, the round's "
            "median 24; it reports 24); it is aggregated as a typical node: each of its changes "
            "is shrunk to the round's median change and it is weighted as 24 examples.") \
        in flower_logs.text
    assert "raise max-update-spread" not in flower_logs.text
    sent = {m.metadata.dst_node_id: m for m in g.sent if m.metadata.message_type == "train"}
    # the reference: node 1000's reply re-signed and held to the median by hand (its weight
    # is the median's, 24, as every node's), the others as sent back
    att = seen[1000].content[P.ARRAYS]
    su, sv = (sent[1000].content[P.ARRAYS][f"hidden.{p}"].numpy().astype(np.float64)
              for p in ("u", "v"))
    u, v = -att["hidden.u"].numpy().astype(np.float64), -att["hidden.v"].numpy().astype(np.float64)
    honest = []
    for node in (1001, 1002):
        hu, hv = (seen[node].content[P.ARRAYS][f"hidden.{p}"].numpy().astype(np.float64)
                  for p in ("u", "v"))
        s_u, s_v = (sent[node].content[P.ARRAYS][f"hidden.{p}"].numpy().astype(np.float64)
                    for p in ("u", "v"))
        honest.append(math.sqrt((np.sum((hu - s_u) ** 2) + np.sum((hv - s_v) ** 2))
                                / (np.sum(s_u ** 2) + np.sum(s_v ** 2))))
    mine = math.sqrt((np.sum((u - su) ** 2) + np.sum((v - sv) ** 2))
                     / (np.sum(su ** 2) + np.sum(sv ** 2)))
    factor = sorted([mine, *honest])[1] / mine  # held to the median change, not 5 x it
    att["hidden.u"] = Array((su + factor * (u - su)).astype(np.float32))
    att["hidden.v"] = Array((sv + factor * (v - sv)).astype(np.float32))
    want = _mean_and_rebuild(sent, seen, before, "hidden")
    np.testing.assert_allclose(new["hidden.weight"].numpy(), want, rtol=1e-5, atol=1e-6)


def test_a_large_claim_buys_no_allowance_beyond_the_weight_cap(
    flower_logs: pytest.LogCaptureFixture,
) -> None:
    # factors x40 move ~9,700 x the median, x5 ~1,000 x: whether the node claims 47, 48 or
    # 90 x the median's 24 examples, it is weighted at most 2 x the median (48), its update is
    # judged against that weight, and it is held to the median; the log says what it reports
    def data_rich(factor: float, examples: int):
        scale, claim = scale_arrays(factor, lambda k: k.endswith((".u", ".v"))), \
            set_metric(P.NUM_EXAMPLES, examples)
        return lambda reply: claim(scale(reply))

    for factor, examples in ((40.0, 47), (40.0, 48), (5.0, 24 * 90)):
        flower_logs.clear()
        g = grid()
        g.tamper[1000] = data_rich(factor, examples)
        _, row = one_round(strategy(max_update_ratio=0.0, max_update_spread=5.0), g)
        assert row["clipped-update-spread"] == 1.0 and row["update-spread-warned"] == 1.0
        assert row["update-spread-held"] == 1.0
        [line] = {r.getMessage() for r in flower_logs.records  # (one line, seen twice)
                  if "changed more than max-update-spread" in r.getMessage()}
        assert line.startswith("Round 1: node 1000 changed more than max-update-spread=5")
        assert (f"further than the data it is weighted for explains ({min(examples, 48)} "
                f"examples, the round's median 24; it reports {examples}); it is aggregated as "
                "a typical node") in line
        assert "raise max-update-spread" not in line  # never loosen the bound


def test_a_node_just_past_the_bound_is_listed_at_info_one_far_past_it_warned(
    flower_logs: pytest.LogCaptureFixture,
) -> None:
    # the same round four times: node 1000's factors inflated 3-fold (one layer of its
    # eight layers and entries); how far its change is over the median (update-spread-max, e)
    # decides the log level against kappa
    def run(kappa: float) -> tuple[dict, list[logging.LogRecord]]:
        flower_logs.clear()
        g = grid()
        g.tamper[1000] = scale_arrays(3.0, lambda k: k.endswith((".u", ".v")))
        _, row = one_round(strategy(max_update_ratio=0.0, max_update_spread=kappa), g)
        return row, [r for r in flower_logs.records if "max-update-spread" in r.getMessage()]

    row, _ = run(1e9)  # measured, not shrunk
    e = row["update-spread-max"]
    assert e > 3.0  # node 1000 is the one far out
    for kappa in (e / 1.5, e / 3.0, e / 9.0):  # one layer beyond κ, within 10κ: INFO
        row, records = run(kappa)
        assert row["clipped-update-spread"] >= 1.0 and "update-spread-warned" not in row
        assert {r.levelno for r in records} == {logging.INFO}, kappa
        assert "node(s) changed a few layers" in records[0].getMessage()
        assert f"(node: largest change over the median: 1000: {e:.3g}x)" in \
            records[0].getMessage()
    row, records = run(e / 11.0)  # one layer beyond 10κ: a WARNING naming the node
    assert row["update-spread-warned"] == 1.0
    assert any(r.levelno == logging.WARNING and "node 1000 changed more than" in r.getMessage()
               for r in records)


def test_a_whole_update_out_of_line_is_warned_a_few_noisy_entries_are_not(
    flower_logs: pytest.LogCaptureFixture,
) -> None:
    # a scaled update moves every layer and entry; an honest node on other data passes the
    # bound on a few (a bias) by a few times the median
    def run(keys, kappa: float | None = None) -> tuple[dict, list[logging.LogRecord]]:
        flower_logs.clear()
        g = grid()
        g.tamper[1000] = scale_arrays(3.0, keys)
        if kappa is None:  # within 10κ of the node's excess: only the breadth can warn
            measured = grid()
            measured.tamper[1000] = scale_arrays(3.0, keys)
            kappa = one_round(strategy(max_update_ratio=0.0, max_update_spread=1e9),
                              measured)[1]["update-spread-max"] / 5.0
        _, row = one_round(strategy(max_update_ratio=0.0, max_update_spread=kappa), g)
        return row, [r for r in flower_logs.records if "max-update-spread" in r.getMessage()]

    row, records = run(lambda k: True, kappa=2.0)  # every array inflated: out of line
    assert row["update-spread-warned"] == 1.0 and row["clipped-update-spread"] >= 4.0
    assert any(r.levelno == logging.WARNING and "node 1000 changed more than" in r.getMessage()
               for r in records)
    row, records = run(lambda k: k == "hidden.bias")  # one noisy entry, 5κ: INFO only
    assert row["clipped-update-spread"] == 1.0 and "update-spread-warned" not in row
    assert {r.levelno for r in records} == {logging.INFO}


def test_a_sign_flip_gives_the_honest_round_bit_for_bit() -> None:
    honest, _ = one_round(strategy(), grid())
    g = grid()
    g.tamper[1001] = scale_arrays(-1.0, lambda k: k.endswith((".u", ".v")))
    attacked, row = one_round(strategy(), g)
    assert row["re-signed-terms"] == 5.0
    for key in honest:
        np.testing.assert_array_equal(attacked[key].numpy(), honest[key].numpy())
    plain, _ = one_round(strategy(align_factors=False), g)  # the averages alone shrink it
    assert not np.array_equal(plain["hidden.weight"].numpy(), honest["hidden.weight"].numpy())


def test_the_new_settings_are_validated_with_their_names() -> None:
    with pytest.raises(SettingsError, match=r"max_update_spread=0.5: expected 0 \(off\) or a "
                       r"finite number ≥ 1"):
        ReplyPolicy(max_update_spread=0.5)
    with pytest.raises(SettingsError, match=r"align_factors=1: expected True or False"):
        ReplyPolicy(align_factors=1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"max-update-spread=nan: expected 0 \(off\)"):
        RunConfig.from_mapping({"max-update-spread": float("nan")})
    cfg = RunConfig.from_mapping({"max-update-spread": 0.0, "align-factors": False})
    assert (cfg.replies.max_update_spread, cfg.replies.align_factors) == (0.0, False)


def test_dense_equivalents_match_a_sum_over_all_terms() -> None:
    rng = np.random.default_rng([31, 6])
    w = rng.normal(size=(5, 6))
    spec = layer_spectrum(w)
    idx = np.array([0, 3], dtype=np.int64)
    u, v = rng.normal(size=(5, 2)), rng.normal(size=(6, 2))
    bias = rng.normal(size=5)
    (state,) = dense_equivalents({"fc.weight": w, "fc.bias": bias}, {"fc": spec},
                                 [{"fc.bias": bias + 1}], [{"fc": TermUpdate(1.0, idx, u, v)}])
    # the reference: all N terms summed, the client's two in place of the sent ones
    ref = np.zeros((5, 6))
    for i in range(spec.lam.size):
        a, b = spec.ut[i], spec.vt[i]
        if i in idx:
            j = int(np.flatnonzero(idx == i)[0])
            a, b = u[:, j], v[:, j]
        ref += np.outer(a, b)
    np.testing.assert_allclose(state["fc.weight"], ref, atol=1e-12)
    np.testing.assert_array_equal(state["fc.bias"], bias + 1)


@pytest.mark.parametrize("rule", ["dense-median", "krum"])
def test_flowers_rules_over_the_dense_equivalent_models(rule: str) -> None:
    g = grid(n=4)
    seen: dict[int, Message] = {}
    for node in g.contexts:
        g.tamper[node] = lambda reply, node=node: seen.setdefault(node, reply)
    g.tamper[1003] = lambda reply: seen.setdefault(1003, scale_arrays(
        -1e3, lambda k: k.endswith((".u", ".v")))(reply))
    s = strategy(aggregation=rule, trim_fraction=0.25, max_update_ratio=0.0,
                 max_update_spread=0.0, align_factors=False)
    start = initial()
    new, _ = one_round(s, g, arrays=start)
    sent = {m.metadata.dst_node_id: m for m in g.sent if m.metadata.message_type == "train"}
    models = {}
    for node, reply in seen.items():  # each node's whole model, term by term
        arrays, out = reply.content[P.ARRAYS], sent[node].content[P.ARRAYS]
        hidden = start["hidden.weight"].numpy().astype(np.float64).copy()
        for j in range(arrays["hidden.indices"].numpy().size):
            hidden += (np.outer(arrays["hidden.u"].numpy()[:, j], arrays["hidden.v"].numpy()[:, j])
                       - np.outer(out["hidden.u"].numpy()[:, j], out["hidden.v"].numpy()[:, j]))
        models[node] = {"hidden.weight": hidden, "head.weight": arrays["head.weight"].numpy()}
    for key in ("hidden.weight", "head.weight"):
        stack = np.stack([models[n][key] for n in sorted(models)])
        if rule == "dense-median":
            want = np.median(stack, axis=0)
        else:  # Krum with f = 1 of 4: each node's score is its n - f - 2 = 1 nearest distance
            flat = {n: np.concatenate([models[n][k].ravel() for k in sorted(models[n])])
                    for n in models}
            score = {n: min(float(np.sum((flat[n] - flat[m]) ** 2)) for m in flat if m != n)
                     for n in flat}
            want = models[min(score, key=score.get)][key]
            assert min(score, key=score.get) != 1003
        np.testing.assert_allclose(new[key].numpy(), want, rtol=1e-5, atol=1e-6)


def test_a_few_terms_in_another_balance_are_info_a_whole_layer_is_warned(
    flower_logs: pytest.LogCaptureFixture,
) -> None:
    # honest training with a large step may move a term's balance; a deliberate change of
    # gauge moves every term: only that is named in a WARNING
    def gauge(columns: slice):
        def hook(reply: Message) -> Message:
            rec = reply.content[P.ARRAYS]
            u, v = rec["hidden.u"].numpy().copy(), rec["hidden.v"].numpy().copy()
            u[:, columns] *= 10.0
            v[:, columns] /= 10.0
            rec["hidden.u"], rec["hidden.v"] = Array(u), Array(v)
            return reply
        return hook

    for columns, level in ((slice(0, 1), logging.INFO), (slice(0, 5), logging.WARNING)):
        flower_logs.clear()
        g = grid()
        g.tamper[1001] = gauge(columns)
        _, row = one_round(strategy(max_update_ratio=0.0), g)
        assert row["rebalanced-terms"] == columns.stop
        [(levelno, message)] = {(r.levelno, r.getMessage()) for r in flower_logs.records  # (seen
                                if "node 1001 returned terms in another sign" in r.getMessage()}
        assert levelno == level  # twice: flwr's handler and the root's)
        assert f"hidden: 0 re-signed, {columns.stop} re-balanced of 5" in message
