"""Why the batched engine's step is slow: the operations one vectorized step of C clients runs
against C steps of one client, and the time of each, side by side in one process.

The batched engine (``fedshard_lab.engine.batched``) trains a round's clients of equal
sub-model shapes as one model: the clients folded into one model's channels where the model
allows, else ``torch.func.vmap`` of ``grad`` over their stacked parameters.
It was built because one client's step on a GPU is bound by kernel launches; it pays only if
the vectorized step launches far fewer kernels than the clients one after another, and if
those kernels are not slower per unit of work. This script counts what each way runs, so
that the answer does not need a GPU to start:

* every ATen operation of one step (forward, backward; the gradient, not the optimizer),
  caught by a ``TorchDispatchMode``: of the batched engine's vmap loss
  (``fedshard_lab.engine.batched``'s ``_client_loss`` under ``vmap(grad(...))``) on ``C``
  stacked clients, and of one client's step of the same sub-model as ``EagerStep`` computes
  it (``cross_entropy_sums``, mean loss, ``backward``);
* the *kernels* among them (operations that are not views: a view launches nothing), per
  step of the batched engine against ``C`` client steps;
* the operations one client's step runs that the batched step does not (no batching rule:
  vmap runs a decomposition of them instead) and those only the batched step runs;
* the kernels of one GroupNorm layer (forward and backward) under ``vmap(grad)`` for ``C``
  clients and for one client alone;
* the same step with the clients *folded* into the channels (``fedshard_lab.engine.folded``:
  every convolution grouped by client, GroupNorm with ``C`` times its groups, the last layer
  per client) and differentiated by autograd without vmap, so that every operation runs its
  own fused backward once for all the clients: what the batched engine runs for the models
  it can fold;
* the convolutions the batched step runs as one grouped convolution (``groups`` = ``C``:
  vmap folds the clients' weights into the channels), whose per-group kernels a GPU library
  may run far below a dense convolution's speed;
* ms per batched step against ``C`` client steps (median of ``--repeats`` blocks, each after
  the other), on ``--device``; with ``--profile`` also the slowest operations of each way
  by their own time (``torch.profiler``: the CUDA kernels' time on a GPU, else the CPU's).

The model is ResNet-18 (GroupNorm) with every sharded layer at the top ``⌈rN⌉`` terms of
``--keep-ratio`` (the CIFAR-10 preset's shape by default: width 64, 32×32×3 images, batch 32,
10 clients, r = 0.1). The operation counts do not depend on the width or the batch; a CPU
measures them in seconds at ``--width 16 --batch 8``.

Usage: ``python benchmarks/bench_batched_kernels.py [--clients 10] [--width 64] [--batch 32]
[--keep-ratio 0.1] [--repeats 5] [--device cpu|cuda] [--profile] [--out FILE]``; prints one
JSON object and, with ``--out``, writes it there with the machine, torch version, date and
command.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.func import grad, vmap
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "lab")]

from bench_client import build  # noqa: E402
from machine import emit, provenance  # noqa: E402

from fedshard.client.train.step import cross_entropy_sums  # noqa: E402
from fedshard_lab.engine.batched import _client_loss  # noqa: E402
from fedshard_lab.engine.folded import fold  # noqa: E402
from fedshard_lab.engine.folded import folded_step as engine_folded_step  # noqa: E402

#: ATen operations that return a view or an alias: they launch no kernel.
VIEW_OPS = frozenset({
    "alias", "as_strided", "detach", "expand", "permute", "reshape", "select", "slice",
    "squeeze", "t", "transpose", "unflatten", "unfold", "unsqueeze", "view", "_unsafe_view",
    "_reshape_alias",
})


class OpCounter(TorchDispatchMode):
    """Counts every ATen operation run under it, by name (``aten.mul.Tensor`` → ``mul``), and
    the ``groups`` of each convolution."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.conv_groups: Counter[int] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        if name == "convolution":
            self.conv_groups[int(args[-1])] += 1
        return func(*args, **(kwargs or {}))


def kernels(ops: Counter[str]) -> int:
    """The operations of ``ops`` that are not views (each launches at least one kernel)."""
    return sum(n for op, n in ops.items() if op not in VIEW_OPS)


def setup(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The sub-model, its stacked copy for ``--clients`` clients and their batches."""
    sub = build(args.width, args.keep_ratio).to(device)
    sub.train()
    trainable = {n: p for n, p in sub.named_parameters() if p.requires_grad}
    buffers = {n: b for n, b in sub.named_buffers()}
    buffers.update({n: p.detach() for n, p in sub.named_parameters() if not p.requires_grad})
    c = args.clients
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(c, args.batch, 3, 32, 32, generator=gen).to(device)
    y = torch.randint(0, 10, (c, args.batch), generator=gen).to(device)

    def stack(t: torch.Tensor) -> torch.Tensor:  # (C, ...): each client's own copy
        return t.detach().unsqueeze(0).repeat(c, *([1] * t.ndim)).contiguous()

    return {"model": sub, "params": {n: stack(p) for n, p in trainable.items()},
            "buffers": {n: stack(b) for n, b in buffers.items()}, "x": x, "y": y,
            "weights": torch.ones(c, args.batch, device=device)}


def batched_step(s: dict[str, Any]) -> Any:
    """Every client's gradient at once by vmap of grad (the batched engine's route for a
    model it cannot fold; ``batched`` in the record)."""
    step = vmap(grad(_client_loss(s["model"]), has_aux=True))
    return lambda: step(s["params"], s["buffers"], s["x"], s["y"], s["weights"])


def client_steps(s: dict[str, Any]) -> Any:
    """The same gradients one client after another, as ``EagerStep`` computes them."""
    model = s["model"]

    def run() -> None:
        for c in range(s["x"].shape[0]):
            model.zero_grad(set_to_none=True)
            loss_sum, _, count = cross_entropy_sums(model(s["x"][c]), s["y"][c])
            (loss_sum / count.clamp_min(1)).backward()
    return run


def folded_step(s: dict[str, Any]) -> Any:
    """Every client's gradient at once with the clients folded into the channels, as the
    batched engine computes it (``fedshard_lab.engine.folded``: autograd, no vmap)."""
    step = engine_folded_step(fold(s["model"]))
    return lambda: step(s["params"], s["buffers"], s["x"], s["y"], s["weights"])


def count_ops(fn: Any) -> OpCounter:
    fn()  # once before: first-call work (imports, autograd setup) is not the step's
    with OpCounter() as counter:
        fn()
    return counter


def group_norm_kernels(clients: int) -> dict[str, int]:
    """Kernels of one GroupNorm layer's forward and backward (16 channels in 2 groups, with
    its affine weight): for ``clients`` clients under ``vmap(grad)``, and for one client."""
    norm = torch.nn.GroupNorm(2, 16)
    x = torch.randn(clients, 4, 16, 8, 8)
    w, b = norm.weight.detach(), norm.bias.detach()
    w_c, b_c = w.repeat(clients, 1), b.repeat(clients, 1)

    def f(w: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.group_norm(x, 2, w, b).sum()

    batched = count_ops(lambda: vmap(grad(f, argnums=(0, 1)))(w_c, b_c, x))
    x0, wr, br = x[0].clone(), w.clone().requires_grad_(), b.clone().requires_grad_()

    def one() -> None:
        wr.grad = br.grad = None
        f(wr, br, x0).backward()
    return {"batched": kernels(batched.ops), "one_client": kernels(count_ops(one).ops)}


def timed(fns: dict[str, Any], repeats: int, device: torch.device) -> dict[str, float]:
    """ms of one call of each, median of ``repeats``, the calls taken in turn."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():  # warm-up: allocator, kernel selection
        fn()
    for _ in range(repeats):
        for key, fn in fns.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[key].append(1e3 * (time.perf_counter() - start))
    return {k: round(statistics.median(v), 3) for k, v in times.items()}


def profile_ops(fn: Any, device: torch.device, top: int = 12) -> list[dict[str, Any]]:
    """The ``top`` operations of one call of ``fn`` by their own time: on the GPU (CUDA
    kernels' time) for a CUDA device, else on the CPU."""
    from torch.profiler import ProfilerActivity, profile
    cuda = device.type == "cuda"
    fn()
    if cuda:
        torch.cuda.synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize(device)

    def own(e: Any) -> float:  # µs
        return float(e.self_device_time_total if cuda else e.self_cpu_time_total)

    rows = sorted(prof.key_averages(), key=lambda e: -own(e))[:top]
    return [{"op": e.key, "calls": e.count, "ms": round(own(e) / 1e3, 3)} for e in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--keep-ratio", type=float, default=0.1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--profile", action="store_true",
                    help="also the slowest operations of each way by their own time (CUDA "
                         "kernels' on a GPU, else the CPU's)")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args()
    if args.clients < 2 or args.width < 1 or args.batch < 1 or args.repeats < 1 or not (
            0 < args.keep_ratio <= 1):
        raise SystemExit("bench_batched_kernels: expected --clients ≥ 2, --width, --batch and "
                         "--repeats ≥ 1 and --keep-ratio in (0, 1]; nothing was run")
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    s = setup(args, device)
    batched, clients, folded = batched_step(s), client_steps(s), folded_step(s)
    b, one, fo = count_ops(batched), count_ops(clients), count_ops(folded)
    c = args.clients
    per_client = Counter({op: n / c for op, n in one.ops.items()})
    only_client = {op: n for op, n in sorted(per_client.items()) if op not in b.ops}
    only_batched = {op: n for op, n in sorted(b.ops.items())
                    if op not in one.ops and op not in VIEW_OPS}
    # a vectorized step should run each operation as often as one client's step does
    more = {op: {"batched": n, "one_client": per_client[op]}
            for op, n in sorted(b.ops.items())
            if op in per_client and op not in VIEW_OPS and n > per_client[op] + 0.5}
    record: dict[str, Any] = {
        **provenance(args.device),
        "shape": {"model": "resnet18 (GroupNorm)", "width": args.width, "batch": args.batch,
                  "image": [3, 32, 32], "clients": c, "keep_ratio": args.keep_ratio},
        "kernels_per_step": {"batched": kernels(b.ops), "clients": kernels(one.ops),
                             "per_client": round(kernels(one.ops) / c, 1),
                             "folded": kernels(fo.ops)},
        "ops_per_step": {"batched": sum(b.ops.values()), "clients": sum(one.ops.values()),
                         "folded": sum(fo.ops.values())},
        "only_per_client": only_client,
        "only_batched": only_batched,
        "more_than_one_client": more,
        "group_norm_layer_kernels": group_norm_kernels(c),
        "convolutions_by_groups": {"batched": dict(b.conv_groups),
                                   "clients": dict(one.conv_groups),
                                   "folded": dict(fo.conv_groups)},
        "ms_per_step": timed({"batched": batched, "clients": clients, "folded": folded},
                             args.repeats, device),
    }
    if args.profile:
        record["profile"] = {"time": "cuda" if device.type == "cuda" else "cpu",
                             "batched": profile_ops(batched, device),
                             "clients": profile_ops(clients, device),
                             "folded": profile_ops(folded, device)}
    emit(record, args.out)


if __name__ == "__main__":
    main()
