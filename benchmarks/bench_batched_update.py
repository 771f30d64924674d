"""The batched engine's training step: torch's own SGD with the client rules on the stacked
parameters (what ``fedshard_lab.engine.batched.train_together`` runs) against the hand-written
SGD-momentum update the engine used before (the baseline, kept here), side by side.

Both steps take the same gradients (one ``torch.func.vmap`` of ``grad`` over the stacked
clients) and apply Frobenius decay and ClipLR; they differ in the update only (and ClipLR's
form: the baseline scales the gradient, the engine scales the move, the same in exact
arithmetic for SGD with momentum). After one untimed run of each (a process's first torch
optimizer imports ``torch._dynamo``, seconds), each repeat times ``--steps`` steps of each, in
turn. Prints
one JSON object: ms per step of each (median over repeats), their ratio, and the largest
relative difference of the parameters after the steps in float64 (the two are the same
arithmetic up to rounding).

Usage: ``python benchmarks/bench_batched_update.py [--clients 10] [--width 200]
[--keep-ratio 0.1] [--steps 20] [--repeats 7] [--device cpu]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from typing import Any

import torch
from machine import cpu_name
from torch import nn
from torch.func import functional_call, grad, vmap

from fedshard.client.train.rules import ClientRules
from fedshard.models import mlp
from fedshard.sampling import num_terms
from fedshard.spectral import SpectralLayer, shard_model


def _stacked(args: argparse.Namespace, dtype: torch.dtype) -> tuple[nn.Module, dict, dict]:
    model = mlp(784, 10, width=args.width).to(dtype)
    layers = ["net.4", "net.7"] if args.width else []
    sub = {}
    for name in layers:
        weight = dict(model.named_modules())[name].weight
        sub[name] = list(range(num_terms(min(weight.shape), args.keep_ratio)))
    omegas = {n: torch.linspace(1.0, 20.0, len(i), dtype=torch.float64) for n, i in sub.items()}
    shard, _ = shard_model(model, sub, omegas)
    shard = shard.to(args.device)
    g = torch.Generator(device="cpu").manual_seed(0)
    params = {n: torch.stack([p.detach() + 0.01 * torch.randn(p.shape, generator=g,
                                                              dtype=dtype).to(p.device)
                              for _ in range(args.clients)])
              for n, p in shard.named_parameters()}
    buffers = {n: torch.stack([b] * args.clients) for n, b in shard.named_buffers()}
    return shard, params, buffers


def _loss(model: nn.Module) -> Any:
    def f(params: dict, buffers: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(functional_call(model, (params, buffers), (x,)), y)
    return f


def run(args: argparse.Namespace, dtype: torch.dtype, repeats: int) -> dict[str, Any]:
    model, base, buffers = _stacked(args, dtype)
    spectral = [(f"{n}." if n else "") for n, m in model.named_modules()
                if isinstance(m, SpectralLayer)]
    factors = {p + f for p in spectral for f in ("u", "v")}
    names = list(base)
    step = vmap(grad(_loss(model)))
    g = torch.Generator(device="cpu").manual_seed(1)
    data = [(torch.randn(args.clients, 32, 784, generator=g, dtype=dtype).to(args.device),
             torch.randint(0, 10, (args.clients, 32), generator=g).to(args.device))
            for _ in range(args.steps)]
    lr, mu, gamma, tau = 0.05, 0.9, 1e-4, 10.0

    def engine() -> dict[str, torch.Tensor]:
        params = {n: p.clone() for n, p in base.items()}
        sgd = torch.optim.SGD([{"params": [params[n] for n in names if n in factors],
                                "weight_decay": 0.0},
                               {"params": [params[n] for n in names if n not in factors]}],
                              lr=lr, momentum=mu)
        rules = ClientRules([_Layer(params[p + "u"], params[p + "v"], buffers[p + "omega"])
                             for p in spectral], frobenius_decay=gamma, clip_lr_tau=tau)
        rules.attach(sgd)
        for x, y in data:
            grads = step(params, buffers, x, y)
            for n in names:
                params[n].grad = grads[n]
            sgd.step()
        return params

    def baseline() -> dict[str, torch.Tensor]:
        params = {n: p.clone() for n, p in base.items()}
        momentum = {n: torch.zeros_like(p) for n, p in params.items()}
        for x, y in data:
            grads = dict(step(params, buffers, x, y))
            with torch.no_grad():
                for prefix in spectral:  # Frobenius decay, then ClipLR on the gradient
                    omega = buffers[prefix + "omega"]
                    u, v = params[prefix + "u"], params[prefix + "v"]
                    weight = 2.0 * gamma * (omega[:, :, None] * omega[:, None, :])
                    gram_u, gram_v = u.mT @ u, v.mT @ v
                    grads[prefix + "u"] = grads[prefix + "u"] + u @ (gram_v * weight)
                    grads[prefix + "v"] = grads[prefix + "v"] + v @ (gram_u * weight)
                    scale = torch.clamp(tau / omega, max=1.0)[:, None, :]
                    grads[prefix + "u"] = grads[prefix + "u"] * scale
                    grads[prefix + "v"] = grads[prefix + "v"] * scale
                for n in names:
                    momentum[n] = momentum[n].mul(mu).add(grads[n])
                    params[n] = params[n].add(momentum[n], alpha=-lr)
        return params

    times: dict[str, list[float]] = {"engine": [], "baseline": []}
    out: dict[str, dict[str, torch.Tensor]] = {}
    engine(), baseline()  # warm-up: the first optimizer of a process imports torch._dynamo
    for _ in range(repeats):
        for name, fn in (("engine", engine), ("baseline", baseline)):
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out[name] = fn()
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t0) / args.steps * 1e3)
    diff = max(float(((out["engine"][n] - out["baseline"][n]).abs().max()
                      / out["baseline"][n].abs().max()).item()) for n in names)
    return {"engine_ms_per_step": statistics.median(times["engine"]),
            "baseline_ms_per_step": statistics.median(times["baseline"]),
            "max_rel_diff": diff}


class _Layer:
    def __init__(self, u: torch.Tensor, v: torch.Tensor, omega: torch.Tensor) -> None:
        self.u, self.v, self.omega = u, v, omega


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--width", type=int, default=200)
    ap.add_argument("--keep-ratio", type=float, default=0.1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(1)
    timed = run(args, torch.float32, args.repeats)
    exact = run(args, torch.float64, 1)
    print(json.dumps({
        "engine_ms_per_step": round(timed["engine_ms_per_step"], 3),
        "baseline_ms_per_step": round(timed["baseline_ms_per_step"], 3),
        "engine_vs_baseline": round(timed["engine_ms_per_step"]
                                    / timed["baseline_ms_per_step"], 3),
        "max_rel_diff_float64": exact["max_rel_diff"],
        "clients": args.clients, "width": args.width, "keep_ratio": args.keep_ratio,
        "steps": args.steps, "repeats": args.repeats, "device": args.device,
        "threads": 1, "cpu": cpu_name(), "torch": torch.__version__,
        "date": datetime.date.today().isoformat()}))


if __name__ == "__main__":
    main()
