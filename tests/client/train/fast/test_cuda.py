"""CUDA training against CPU training and compiled against eager; skipped without a GPU."""

from __future__ import annotations

import copy
import gc
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from trainconf import with_

from fedshard.client.train import TrainConfig, train
from fedshard.client.train.fast import STEP_POOL, TrainStep, conv_form
from fedshard.models import resnet18
from fedshard.settings import LocalTraining
from fedshard.spectral import SpectralConv2d, shard_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def _empty_step_pool() -> Iterator[None]:
    """Each test captures its own graphs (cuda_graph pools the step by default)."""
    STEP_POOL.clear()
    yield
    STEP_POOL.clear()


@pytest.fixture(autouse=True)
def _no_tf32() -> Iterator[None]:
    """TF32 would round products to 10 mantissa bits: compare true float32 arithmetic."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _submodel(dtype: torch.dtype = torch.float32) -> nn.Module:
    dense = resnet18(num_classes=10, width=16, seed=0)
    layers = {
        "layer1.0.conv1": list(range(6)),
        "layer2.0.conv2": list(range(10)),
        "layer3.1.conv1": list(range(12)),
        "layer4.0.downsample.0": list(range(8)),
    }
    omegas = {name: torch.linspace(1.0, 20.0, len(i)) for name, i in layers.items()}
    sub, _ = shard_model(dense, layers, omegas)
    return sub.to(dtype)


def _loader(dtype: torch.dtype = torch.float32) -> DataLoader[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 3, 32, 32, generator=g, dtype=dtype)
    return DataLoader(TensorDataset(x, torch.randint(0, 10, (24,), generator=g)), batch_size=8)


def _assert_close(a: nn.Module, b: nn.Module, rtol: float, atol: float) -> None:
    for (key, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        diff = (x.cpu().double() - y.cpu().double()).abs().max().item() if x.numel() else 0.0
        scale = y.cpu().double().abs().max().item() if y.numel() else 0.0
        torch.testing.assert_close(x.cpu(), y.cpu(), rtol=rtol, atol=atol,
                                   msg=f"{key}: max |diff| {diff:.3g}, max |value| {scale:.3g}")


CFG = TrainConfig(recipe=LocalTraining(local_epochs=1, lr=0.02, clip_lr_tau=10.0),
                  log_every_epoch=False, max_grad_norm=5.0)


def test_cuda_training_matches_cpu_training() -> None:
    on_cpu, on_cuda = _submodel(), _submodel()
    want = train(on_cpu, _loader(), CFG)
    got = train(on_cuda, _loader(), with_(CFG, device="cuda"))
    _assert_close(on_cuda, on_cpu, rtol=1e-4, atol=1e-5)  # float32 rounding, 3 steps
    assert got.loss == pytest.approx(want.loss, rel=1e-4)


def test_compiled_cuda_training_matches_eager() -> None:
    """Inductor's fused kernels against eager's, in float64: in float32 the two differed by
    1.6e-5 on conv1.weight of scale 0.35 after 6 steps (H100, 2026-11-27; it passed at the
    same bound on an H200 the day before), the rounding of other kernels amplified by
    training. float64 rounding amplified as much stays far below 1e-9, while a compiled step
    that computed another gradient or update would be off by ~lr * grad (1e-3 and more)."""
    eager, compiled = _submodel(torch.float64), _submodel(torch.float64)
    cfg = with_(CFG, device="cuda", local_epochs=2)
    want = train(eager, _loader(torch.float64), cfg)
    got = train(compiled, _loader(torch.float64), with_(cfg, compile=True))
    _assert_close(compiled, eager, rtol=1e-9, atol=1e-11)
    assert got.loss == pytest.approx(want.loss, rel=1e-10)


def test_cuda_step_never_waits_for_the_device() -> None:
    model = _submodel().cuda()
    step = TrainStep(model, with_(CFG, device="cuda"))
    batches = [(x.cuda(), y.cuda()) for x, y in _loader()]
    step(*batches[0])  # first step: lazy state (momentum buffers)
    before = copy.deepcopy(model.state_dict())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x, y in batches[1:]:
            step(x, y)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not torch.equal(before["layer1.0.conv1.u"], model.state_dict()["layer1.0.conv1.u"])


@pytest.mark.parametrize("warmup", [3, 1])
def test_cuda_graph_training_matches_eager(warmup: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole-step CUDA graph replays the eager step: warm-up steps, a capture, then
    replays, and a short last batch (its own warm-up, no graph) in every epoch.

    In float64: in float32 the two runs differed by 7.6e-5 on conv1.weight of scale 0.35
    after these 16 steps (H200, torch 2.11, 2026-11-28; both warm-ups alike), the rounding of
    kernels that order their sums differently amplified by training, while this float64 run
    passed the bounds below there. A graph that replayed a stale batch, skipped an update or
    applied the client rules otherwise would be off by ~lr * grad (1e-3 and more)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(60, 3, 32, 32, generator=g, dtype=torch.float64)
    data = TensorDataset(x, torch.randint(0, 10, (60,), generator=g))
    cfg = with_(CFG, device="cuda", local_epochs=2)
    monkeypatch.setattr("fedshard.client.train.fast.step._StepGraphs._WARMUP", warmup)
    saved = torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = True
    try:
        eager, graphed = _submodel(torch.float64), _submodel(torch.float64)
        r1 = train(eager, DataLoader(data, batch_size=8), cfg)
        r2 = train(graphed, DataLoader(data, batch_size=8), with_(cfg, cuda_graph=True))
    finally:
        torch.backends.cudnn.deterministic = saved
    assert r1.num_examples == r2.num_examples == 60
    assert r2.loss == pytest.approx(r1.loss, rel=1e-10), (r1.loss, r2.loss)
    _assert_close(eager, graphed, rtol=1e-9, atol=1e-11)


def test_compiled_cuda_graph_training_replays_the_compiled_step() -> None:
    """compile + cuda_graph: Inductor's kernels (no CUDA-graph trees of their own) captured in
    the whole-step graph must give what the same compiled code gives unreplayed
    (``test_compiled_cuda_training_matches_eager`` ties that to eager); a second model of the
    same structure reuses the compiled code.

    In float64: in float32 the two runs differed by 1.9e-4 (H100, 2026-11-26, against eager)
    and 7.7e-5 (H200, 2026-11-27, against the unreplayed compiled run) on conv1.weight of
    scale 0.34 after 16 steps at lr 0.05. Both runs may pick different compiled kernels for a
    step (the short last batch makes Dynamo recompile with a dynamic batch size, and which
    entry a full batch meets depends on the order of compilation and capture), and training
    amplifies their float32 rounding ~10^3 times. float64 rounding amplified as much stays
    below 1e-12, so a 1e-9 bound still catches a wrong replay (a stale batch or a missed
    update moves weights by ~lr * grad, 1e-3 and more)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(60, 3, 32, 32, generator=g, dtype=torch.float64)
    data = TensorDataset(x, torch.randint(0, 10, (60,), generator=g))
    cfg = with_(CFG, device="cuda", local_epochs=2, compile=True)
    saved = torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = True
    try:
        for lr in (0.02, 0.05):
            compiled, graphed = _submodel(torch.float64), _submodel(torch.float64)
            r1 = train(compiled, DataLoader(data, batch_size=8), with_(cfg, lr=lr))
            r2 = train(graphed, DataLoader(data, batch_size=8),
                       with_(cfg, lr=lr, cuda_graph=True))
            assert r2.num_examples == 60
            assert r2.loss == pytest.approx(r1.loss, rel=1e-10), (lr, r1.loss, r2.loss)
            _assert_close(graphed, compiled, rtol=1e-9, atol=1e-11)
    finally:
        torch.backends.cudnn.deterministic = saved


def test_cuda_graph_pads_thin_convolutions_and_matches_cpu() -> None:
    """Under cuda_graph (no compile) train pads the sub-model's thin convolutions to
    multiples of 8 zero terms (configure_convolutions: on the caller's model, which the pooled
    copy was made from); the trained factors still match unpadded CPU training."""
    on_cpu, on_cuda = _submodel(), _submodel()
    train(on_cpu, _loader(), CFG)
    train(on_cuda, _loader(), with_(CFG, device="cuda", cuda_graph=True))
    (entry,) = STEP_POOL._entries.values()  # the pooled copy is what trained
    pads = {m.pad_terms_to for m in entry.model.modules() if hasattr(m, "pad_terms_to")}
    assert pads == {8}
    assert {m.pad_terms_to for m in on_cuda.modules() if hasattr(m, "pad_terms_to")} == {8}
    assert {conv_form(m)[0] for m in on_cpu.modules() if isinstance(m, SpectralConv2d)} == {1}
    _assert_close(on_cuda, on_cpu, rtol=1e-4, atol=1e-5)


def test_pooled_cuda_graphs_train_later_clients_like_their_own_graphs() -> None:
    """Three clients of one shape (own weights, ω and data) on one pooled step: the later
    two replay the first one's full-batch graph (no warm-up, no capture) and still get what
    a step captured for each of them gives, and what eager gives with the same padded thin
    convolutions (``pad_terms=8``: the same cuDNN kernels, deterministic). Each has its own
    short last batch; the entry keeps at most three graphs.

    Eager is padded because unpadded eager runs other kernels: against it the pooled step
    differed by 1.1e-4 on conv1.weight of scale 0.35 (H200, 2026-11-27, float32, ω up to
    60), while it matched each client's own graphs to 1e-5. Padded eager makes the float32
    comparison tight, in the dtype clients train in. (A float64 version passed three of
    four runs on an H100, 2026-11-27; in the first, one capture failed with
    cudaErrorStreamCaptureInvalidated: a garbage collection inside the capture destroyed an
    earlier test's dead graph, see ``test_no_garbage_collection_runs_inside_a_real_capture``.)
    A graph that replayed a stale batch, another client's ω or a missed update would move
    the weights by ~lr * grad, 1e-3 and more."""
    cfg = with_(CFG, device="cuda", local_epochs=2, cuda_graph=True)
    saved = torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = True
    try:
        for client in range(3):
            g = torch.Generator().manual_seed(10 + client)
            n = 44 + client  # 5 batches of 8, then 4, 5 or 6: a short batch of its own
            data = TensorDataset(torch.randn(n, 3, 32, 32, generator=g),
                                 torch.randint(0, 10, (n,), generator=g))
            models = [_submodel() for _ in range(3)]
            with torch.no_grad():
                for m in models:
                    for name, t in m.state_dict().items():
                        if name.endswith("omega"):
                            t.mul_(1.0 + client)  # ω above τ = 10: ClipLR clips differently
                        elif t.is_floating_point():
                            t.add_(0.01 * client)
            runs = [train(m, DataLoader(data, batch_size=8), c) for m, c in zip(models, (
                with_(cfg, cuda_graph=False, pad_terms=8),
                with_(cfg, reuse_step=False),
                cfg), strict=True)]
            eager, own, pooled = models
            assert runs[2].loss == pytest.approx(runs[1].loss, rel=1e-5), client
            assert runs[2].loss == pytest.approx(runs[0].loss, rel=1e-5), client
            _assert_close(pooled, own, rtol=1e-4, atol=1e-5)
            _assert_close(pooled, eager, rtol=1e-4, atol=1e-5)
    finally:
        torch.backends.cudnn.deterministic = saved
    (entry,) = STEP_POOL._entries.values()
    assert entry.uses == 3 and entry.step._graphs is not None
    # _MAX_GRAPHS = 3: the full batch and the two latest short ones (4 was dropped)
    assert sorted(key[0][0] for key in entry.step._graphs.graphs) == [5, 6, 8]


def test_no_garbage_collection_runs_inside_a_real_capture() -> None:
    """The capture runs with Python's collector off (``tests/client/train/fast/test_step_graphs.py``
    checks the logic on the CPU): a collection there can free an unreachable CUDA graph
    (a dropped step's), and destroying a graph while a stream captures invalidates the capture
    (cudaErrorStreamCaptureInvalidated: seen once on an H100 in a float64 version of the
    pooled test, then reproduced there at will by collecting a dead captured step inside
    another step's capture; the same collection without a dead graph captured fine)."""
    model = _submodel()
    seen: list[bool] = []

    def record(module: nn.Module, args: object) -> None:
        if torch.cuda.is_current_stream_capturing():
            seen.append(gc.isenabled())

    model.register_forward_pre_hook(record)
    cfg = with_(CFG, device="cuda", cuda_graph=True, reuse_step=False)
    train(model, _loader(), cfg)  # 3 batches of 8: warm-up, capture, replay
    assert seen == [False]
    assert gc.isenabled()
