"""The step pool (TrainConfig.reuse_step): clients trained one after another on one pooled
step give exactly what each gets from a fresh step (float64, CPU; the CUDA-graph case is in
test_cuda.py), and models that differ in anything that shapes the step never share one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from trainconf import with_

from fedshard.client.train import EagerStep, TrainConfig, train
from fedshard.client.train.fast import (
    STEP_POOL,
    FastOptions,
    StepPool,
    TrainStep,
    configure_convolutions,
    conv_form,
    model_signature,
)
from fedshard.settings import LocalTraining
from fedshard.spectral import SpectralConv2d, SpectralLinear

D = torch.float64


@pytest.fixture(autouse=True)
def _fresh_pool() -> Iterator[None]:
    torch.set_num_threads(1)
    STEP_POOL.clear()
    yield
    STEP_POOL.clear()


def _client_model(client: int, omega: tuple[float, ...] = (1.0, 3.0, 12.0, 30.0),
                  stride: int = 1) -> nn.Sequential:
    """A conv sub-model with len(omega) terms; every client has its own factors, ω and head."""
    g = torch.Generator().manual_seed(100 + client)
    n = len(omega)
    conv = SpectralConv2d(
        torch.randn(5, n, generator=g, dtype=D) / 2,
        torch.randn(3 * 9, n, generator=g, dtype=D) / 3,
        torch.tensor(omega, dtype=D) * (1 + 0.5 * client),  # ω differs per client
        0.1 * torch.randn(5, generator=g, dtype=D),
        in_channels=3, kernel_size=3, padding=1, stride=stride,
    )
    side = 6 if stride == 1 else 3
    lin = SpectralLinear(
        torch.randn(7, 3, generator=g, dtype=D) / 2,
        torch.randn(5 * side * side, 3, generator=g, dtype=D) / 8,
        torch.tensor([2.0, 9.0, 25.0], dtype=D) / (1 + client),
        torch.zeros(7, dtype=D),
    )
    head = nn.Linear(7, 3).to(D)
    with torch.no_grad():
        head.weight.copy_(torch.randn(3, 7, generator=g, dtype=D))
        head.bias.copy_(torch.randn(3, generator=g, dtype=D))
    return nn.Sequential(conv, nn.GroupNorm(1, 5).to(D), nn.ReLU(), nn.Flatten(), lin,
                         nn.Tanh(), head)


def _loader(client: int, n: int = 22) -> DataLoader[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(200 + client)
    data = TensorDataset(torch.randn(n, 3, 6, 6, generator=g, dtype=D),
                         torch.randint(0, 3, (n,), generator=g))
    return DataLoader(data, batch_size=8, shuffle=True,
                      generator=torch.Generator().manual_seed(client))  # 8, 8, n - 16


# ClipLR τ = 10 clips some columns (ω up to 60), weight decay on the dense parameters
CFG = TrainConfig(recipe=LocalTraining(local_epochs=2, lr=0.02, momentum=0.9, frobenius_decay=1e-2,
                                       clip_lr_tau=10.0, weight_decay=1e-3), log_every_epoch=False)


def _same(a: nn.Module, b: nn.Module) -> None:
    for (key, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), f"{key}: max |diff| {(x - y).abs().max().item():.3g}"


def test_clients_trained_on_one_pooled_step_equal_fresh_training() -> None:
    """Four clients (different factors, ω, data and data sizes) one after another on one
    pooled step, bit for bit as each trained by the plain loop's eager step: the momentum
    restarts at zero, ClipLR's scales and Frobenius decay's ωω^T follow each client's ω."""
    sizes = (22, 19, 22, 30)  # last batches of 6, 3, 6 and 6 examples
    for client, n in enumerate(sizes):
        fresh, pooled = _client_model(client), _client_model(client)
        want = train(fresh, _loader(client, n), with_(CFG, reuse_step=False))
        got = train(pooled, _loader(client, n), with_(CFG, reuse_step=True))
        _same(pooled, fresh)
        assert (got.loss, got.accuracy, got.num_examples) == \
            (want.loss, want.accuracy, want.num_examples), client
    assert len(STEP_POOL) == 1
    (entry,) = STEP_POOL._entries.values()
    assert entry.uses == len(sizes)


def test_pooled_compiled_step_trains_later_clients_like_eager() -> None:
    """compile + pool (the fastest GPU setting pools under cuda_graph): the second client
    runs the first one's compiled code on the pooled copy and still matches eager."""
    try:
        import torch._inductor
    except ImportError as err:  # pragma: no cover - inductor ships with torch
        pytest.skip(f"torch.compile's inductor backend cannot be imported here: {err}")
    cfg = with_(CFG, local_epochs=1)
    for client in range(2):
        eager, pooled = _client_model(client).float(), _client_model(client).float()
        loader = DataLoader(TensorDataset(*(t.float() if t.is_floating_point() else t
                                            for t in _loader(client).dataset.tensors)),
                            batch_size=8)
        want = train(eager, loader, cfg)
        got = train(pooled, loader, with_(cfg, compile=True, reuse_step=True))
        for (key, x), y in zip(pooled.state_dict().items(), eager.state_dict().values(),
                               strict=True):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=key)
        assert got.loss == pytest.approx(want.loss, rel=1e-5)
    (entry,) = STEP_POOL._entries.values()
    assert entry.uses == 2


def test_pooled_training_leaves_earlier_clients_models_alone() -> None:
    first, second = _client_model(0), _client_model(1)
    cfg = with_(CFG, reuse_step=True)
    train(first, _loader(0), cfg)
    after_first = {k: v.clone() for k, v in first.state_dict().items()}
    train(second, _loader(1), cfg)
    for key, value in first.state_dict().items():
        assert torch.equal(value, after_first[key]), key
    assert conv_form(first[0])[0] == 1  # the CPU default: no padding


def test_anything_that_shapes_the_step_gets_its_own_entry() -> None:
    base = model_signature(_client_model(0), CFG)
    assert base is not None
    assert model_signature(_client_model(3), CFG) == base  # other values, same shapes
    others = {
        "terms": model_signature(_client_model(0, omega=(1.0, 2.0, 3.0)), CFG),
        "stride": model_signature(_client_model(0, stride=2), CFG),
        "lr": model_signature(_client_model(0), with_(CFG, lr=0.01)),
        "momentum": model_signature(_client_model(0), with_(CFG, momentum=0.5)),
        "tau": model_signature(_client_model(0), with_(CFG, clip_lr_tau=None)),
        "dtype": model_signature(_client_model(0).float(), CFG),
        "eval mode": model_signature(_client_model(0).eval(), CFG),
    }
    frozen = _client_model(0)
    frozen[-1].bias.requires_grad_(False)
    others["requires_grad"] = model_signature(frozen, CFG)
    eps = _client_model(0)
    norm = eps[1]
    assert isinstance(norm, nn.GroupNorm)
    norm.eps = 1e-3  # a plain attribute the forward reads
    others["attribute"] = model_signature(eps, CFG)
    for what, signature in others.items():
        assert signature is not None and signature != base, what
    assert len(set(others.values())) == len(others)


def test_models_with_hooks_or_their_own_forward_are_never_pooled() -> None:
    hooked = _client_model(0)
    calls: list[int] = []
    hooked[0].register_forward_hook(lambda *_: calls.append(1))
    assert model_signature(hooked, CFG) is None
    train(hooked, _loader(0), with_(CFG, reuse_step=True))
    assert len(calls) == 6 and len(STEP_POOL) == 0  # 3 batches x 2 epochs, the hook ran
    patched = _client_model(0)
    patched[2].forward = lambda x: torch.relu(x) * 2
    assert model_signature(patched, CFG) is None


def test_load_state_makes_a_used_step_train_another_model_as_a_fresh_step() -> None:
    """The one operation the pool needs of a step: after training client 0, load_state(client
    1) and the same steps give what a fresh eager step gives client 1; store_state copies the
    result out, and the model the step was built on is not the caller's."""
    batches = [(x, y) for x, y in _loader(1)]
    used = TrainStep(_client_model(0), with_(CFG, pad_terms=1))
    for x, y in _loader(0):
        used(x, y)
    caller, fresh = _client_model(1), _client_model(1)
    before = {k: v.clone() for k, v in caller.state_dict().items()}
    used.load_state(caller)
    eager = EagerStep(fresh, CFG)
    for x, y in batches:
        got, want = used(x, y), eager(x, y)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    _same(caller, _client_model(1))  # untouched until store_state
    assert all(torch.equal(v, before[k]) for k, v in caller.state_dict().items())
    used.store_state(caller)
    _same(caller, fresh)


def test_the_fast_path_changes_convolutions_only_when_asked_and_by_name() -> None:
    """TrainStep does not rewrite the model's layers: it refuses convolutions that are not in
    the form the config asks for, and configure_convolutions (what train's fast path calls)
    sets that form explicitly; the plain loop leaves the layers alone."""
    padded = with_(CFG, pad_terms=8)
    assert padded.fast_enabled() and with_(CFG, merge_terms=True).fast_enabled()
    assert not CFG.fast_enabled() and not with_(CFG, pad_terms=1).fast_enabled()
    model = _client_model(0)
    with pytest.raises(ValueError, match=r"\(pad_terms_to, merge_terms\) = \(8, False\), the "
                                         r"model has \[\(1, False\)\]; call .*"
                                         r"configure_convolutions\(model, cfg\) first"):
        TrainStep(model, padded)
    assert conv_form(model[0]) == (1, False)
    configure_convolutions(model, padded)
    assert (model[0].pad_terms_to, model[0].merge_terms) == (8, False)
    TrainStep(model, padded)  # now it may
    plain = _client_model(0)
    train(plain, _loader(0), CFG)
    assert type(plain[0]) is SpectralConv2d  # the plain layer: not switched


def test_pool_keeps_the_most_recently_used_entries() -> None:
    pool = StepPool(size=2)
    models = [_client_model(0, omega=w) for w in ((1.0,), (1.0, 2.0), (1.0, 2.0, 3.0))]
    for model in (models[0], models[1], models[0], models[2]):
        with pool.lease(model, CFG) as step:
            step(torch.randn(2, 3, 6, 6, dtype=D), torch.tensor([0, 1]))
    kept = {e.step.rules.layers[0].omega.numel() for e in pool._entries.values()}
    assert kept == {1, 3}  # models[1] was the least recently used
    with pytest.raises(ValueError, match=r"StepPool size=0: expected an int >= 1"):
        StepPool(size=0)


def test_a_new_learning_rate_replaces_the_entry_of_the_same_model() -> None:
    """The next round (cosine lr) needs new graphs: the old round's entry is freed, while a
    model of another shape keeps its own."""
    pool = StepPool(size=4)
    batch = (torch.randn(2, 3, 6, 6, dtype=D), torch.tensor([0, 1]))
    other = _client_model(0, omega=(1.0, 2.0))
    for lr in (0.05, 0.04, 0.03):
        for model in (_client_model(0), other):
            with pool.lease(model, with_(CFG, lr=lr)) as step:
                step(*batch)
    assert len(pool) == 2
    assert {k[-1][0] for k in pool._entries} == {0.03}


def test_an_entry_in_use_is_not_lent_twice() -> None:
    pool = StepPool()
    a, b = _client_model(0), _client_model(1)
    with pool.lease(a, CFG) as outer, pool.lease(b, CFG) as inner:
        assert inner is not outer and inner.model is b  # a fresh step on the caller's model
    assert len(pool) == 1


def test_clients_training_in_threads_at_once_each_get_their_own_result() -> None:
    """The in-process grid may run ClientApps in threads: six clients of one shape trained
    concurrently with the pool equal their fresh trainings."""
    import threading

    cfg = with_(CFG, reuse_step=True)
    models = [_client_model(c) for c in range(6)]
    errors: list[BaseException] = []

    def work(c: int) -> None:
        try:
            train(models[c], _loader(c), cfg)
        except BaseException as err:  # pragma: no cover - reported below
            errors.append(err)

    # daemon threads and a bounded join: a deadlock fails this test instead of hanging the suite
    threads = [threading.Thread(target=work, args=(c,), daemon=True) for c in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a training thread did not finish in 300 s"
    assert not errors
    for c, model in enumerate(models):
        fresh = _client_model(c)
        train(fresh, _loader(c), with_(CFG, reuse_step=False))
        _same(model, fresh)


def test_a_failed_training_drops_its_entry_and_leaves_the_model_as_it_was() -> None:
    model = _client_model(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(FloatingPointError, match=r"training loss became"):
        train(model, _loader(0), with_(CFG, lr=1e12, clip_lr_tau=None,
                                                     reuse_step=True))
    assert len(STEP_POOL) == 0
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    # the next client of the same shape starts from a new entry and trains as a fresh step
    fresh, pooled = _client_model(1), _client_model(1)
    train(fresh, _loader(1), with_(CFG, reuse_step=False))
    train(pooled, _loader(1), with_(CFG, reuse_step=True))
    _same(pooled, fresh)


def test_a_pooled_cuda_graph_still_needs_a_cuda_device() -> None:
    with pytest.raises(ValueError, match=r"cuda_graph=True needs the model on a CUDA device"):
        train(_client_model(0), _loader(0), with_(CFG, cuda_graph=True))
    assert len(STEP_POOL) == 0


def test_reuse_step_is_validated() -> None:
    with pytest.raises(ValueError, match=r"reuse_step='yes': expected True, False or None"):
        TrainConfig(fast=FastOptions(reuse_step="yes"))  # type: ignore[arg-type]


@pytest.fixture
def released(monkeypatch: pytest.MonkeyPatch) -> list[TrainStep]:
    """The steps whose graphs were released (TrainStep.release_graphs), in order."""
    seen: list[TrainStep] = []
    original = TrainStep.release_graphs

    def record(self: TrainStep) -> None:
        seen.append(self)
        original(self)

    monkeypatch.setattr(TrainStep, "release_graphs", record)
    return seen


def test_every_entry_the_pool_drops_has_its_graphs_released(released: list[TrainStep]) -> None:
    """A dropped entry's step is a reference cycle that only the garbage collector frees, so
    the pool frees its graphs when it drops it: replaced by the next round's learning rate,
    evicted as least recently used, dropped after a failed training, or cleared."""
    pool = StepPool(size=2)
    batch = (torch.randn(2, 3, 6, 6, dtype=D), torch.tensor([0, 1]))

    def use(model: nn.Module, cfg: TrainConfig) -> TrainStep:
        with pool.lease(model, cfg) as step:
            step(*batch)
        return step

    first = use(_client_model(0), CFG)
    assert released == []
    second = use(_client_model(0), with_(CFG, lr=0.01))  # next round's lr
    assert released == [first]
    third = use(_client_model(0, omega=(1.0,)), CFG)
    fourth = use(_client_model(0, omega=(1.0, 2.0)), CFG)  # size 2: `second` is evicted
    assert released == [first, second]
    with pytest.raises(RuntimeError, match="boom"), pool.lease(_client_model(0, (1.0,)), CFG):
        raise RuntimeError("boom")  # a failed training drops its entry
    assert released == [first, second, third]
    pool.clear()
    assert released == [first, second, third, fourth] and len(pool) == 0


def test_steps_outside_the_pool_release_their_graphs_too(released: list[TrainStep]) -> None:
    pool = StepPool()
    a, b = _client_model(0), _client_model(1)
    with pool.lease(a, CFG) as outer, pool.lease(b, CFG) as inner:
        pass
    assert released == [inner]  # the fresh step of the busy entry's second caller
    # a fast option without pooling: train's own fresh TrainStep
    train(_client_model(2), _loader(2), with_(CFG, reuse_step=False, local_epochs=1,
                                                            pad_terms=2))
    assert len(released) == 2 and released[1] is not outer
    # no fast option: the plain loop's eager step, nothing captured, nothing to release
    train(_client_model(3), _loader(3), with_(CFG, reuse_step=False, local_epochs=1))
    assert len(released) == 2
