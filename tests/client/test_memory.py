"""A keep ratio from a device's memory (fedshard.client.memory): the search against brute
force over a known growth curve, the measurement itself, and the errors a node gets."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fedshard.client.memory as memory
from fedshard.client.handlers import handle_query
from fedshard.client.memory import FIT_SHARE, KEEP_RATIO_GRID, keep_ratio_for_memory
from fedshard.models import resnet18
from fedshard.protocol import query_message, read_capabilities

MIB = 2**20
LINUX = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(),
                           reason="needs Linux's /proc/self/clear_refs (resident high-water mark)")


def _batches(n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g))
            for _ in range(2)]


@pytest.mark.parametrize("budget_mb", [700, 800, 900, 1000, 1100, 1400, 2000])
def test_the_largest_fitting_ratio_is_chosen_and_nothing_past_the_budget_is_measured(
        budget_mb: float, monkeypatch: pytest.MonkeyPatch) -> None:
    # growth a + b r (what the process adds while training at r), resident 500 MB
    a, b, resident = 150 * MIB, 800 * MIB, 500 * MIB
    measured: list[float] = []

    def growth(model: torch.nn.Module, batches: object, cfg: object, baseline: int) -> int:
        terms = model.layer4[0].conv2.rank  # width 8: N = 64 there
        r = 0.0 if terms == 1 else terms / 64
        measured.append(r)
        return int(a + b * r)

    monkeypatch.setattr(memory, "training_growth", growth)
    monkeypatch.setattr(memory, "resident_bytes", lambda: resident)
    # candidates whose n = ceil(r·64) on layer4 is exactly r·64 (so the fake reads r back)
    candidates = (0.125, 0.25, 0.5, 0.75, 1.0)
    limit = FIT_SHARE * budget_mb * MIB
    fitting = [r for r in candidates if resident + a + b * r <= limit]  # brute force
    model = resnet18(10, 1, 8, seed=0)
    if not fitting:
        with pytest.raises(ValueError, match=rf"memory-mb={budget_mb}: not even the smallest"):
            keep_ratio_for_memory(model, _batches(), budget_mb, candidates=candidates)
        return
    fit = keep_ratio_for_memory(model, _batches(), budget_mb, candidates=candidates)
    assert fit.keep_ratio == max(fitting)
    assert measured[0] == 0.0 and measured[1:] == sorted(measured[1:])  # the floor, then up
    assert all(resident + a + b * r <= limit for r in measured[:-1])
    assert max(measured) <= min([r for r in candidates if r > max(fitting)], default=1.0)
    assert set(fit.peaks) == set(measured) - {0.0}
    assert f"memory-mb={budget_mb}: keep ratio {max(fitting):g}" in fit.line()


def test_a_declared_keep_ratio_caps_the_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "training_growth", lambda *args: 10 * MIB)
    monkeypatch.setattr(memory, "resident_bytes", lambda: 100 * MIB)
    fit = keep_ratio_for_memory(resnet18(10, 1, 8, seed=0), _batches(), 10_000, cap=0.3)
    assert fit.keep_ratio == max(r for r in KEEP_RATIO_GRID if r <= 0.3)
    with pytest.raises(ValueError, match=r"keep-ratio=0.01 with memory-mb: no candidate"):
        keep_ratio_for_memory(resnet18(10, 1, 8, seed=0), _batches(), 10_000, cap=0.01)


@LINUX
def test_the_measured_growth_follows_the_model_and_the_batch() -> None:
    # The resident high-water mark of two real steps: a batch of 64 holds more than one of 4
    # (the activations), measured from the same baseline.
    from fedshard.client.train import TrainConfig

    model = resnet18(10, 1, 16, seed=0)
    cfg = TrainConfig(log_every_epoch=False)
    base = memory.resident_bytes()
    big = memory.training_growth(model, _batches(64), cfg, base)
    small = memory.training_growth(model, _batches(4), cfg, base)
    assert big > small + 10 * MIB, (big, small)


@LINUX
def test_a_budget_below_the_smallest_ratio_is_a_clear_error() -> None:
    model = resnet18(10, 1, 8, seed=0)
    with pytest.raises(ValueError, match=r"memory-mb=1: not even the smallest candidate fits: "
                       r"training one term per sharded layer reached \d+ MB .*expected "
                       r"memory-mb ≥ \d+"):
        keep_ratio_for_memory(model, _batches(), 1)


@pytest.mark.parametrize("bad", [-5, 0, float("nan"), float("inf"), True, "512"])
def test_a_bad_memory_mb_names_the_setting(bad: object) -> None:
    with pytest.raises(ValueError, match=r"memory-mb=.*: expected a finite number of MiB > 0"):
        keep_ratio_for_memory(resnet18(10, 1, 8, seed=0), _batches(), bad)  # type: ignore


def test_the_capability_reply_carries_the_budget_and_the_server_reads_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):  # as a grid does
        monkeypatch.setattr(TaskIdentity, name, value)
    fit = memory.MemoryFit(keep_ratio=0.2, memory_mb=900.0, resident_mb=500.0,
                           peaks={0.1: 200 * MIB, 0.2: 300 * MIB}, batch_size=32)
    reply = handle_query(query_message(7), fit, "phone-3")
    caps, note = read_capabilities(reply)
    assert caps is not None and not note
    assert (caps.keep_ratio, caps.key, caps.memory_mb) == (0.2, "phone-3", 900.0)
    assert caps.training_peak_mb == pytest.approx(800.0)
    assert caps.memory_line() == ("keep ratio 0.2 chosen from memory-mb=900, training peak "
                                  "800.0 MB measured")
    reply.content["capabilities"]["memory-mb"] = -1.0  # a reading that makes no sense
    caps, note = read_capabilities(reply)
    assert caps is not None and caps.keep_ratio == 0.2 and caps.memory_mb is None
    assert "memory-mb=-1.0 is not a number > 0 and is ignored" in note


def test_the_servers_hint_for_a_budget_too_small_points_at_memory_mb() -> None:
    from fedshard.server.stops import likely_fix

    reason = ("error reply: ValueError('memory-mb=300: not even the smallest candidate fits: "
              "training keep ratio 0.05 reached 820 MB (700 MB before training + 120 MB for "
              "two steps at batch 32)')")
    hint = likely_fix(reason)
    assert "raise memory-mb" in hint and "ShardingClientApp" not in hint
