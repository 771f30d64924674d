"""Checkpoints: the previous one is kept, a non-finite model is never saved, damage is named."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from fedshard.app.checkpoint import Checkpoint, CheckpointError

CONFIG = {"seed": 0, "lr": 0.05}


def _ckpt(server_round: int, value: float = 1.0) -> Checkpoint:
    return Checkpoint(
        server_round,
        {"w": np.full((2, 3), value, dtype=np.float32), "steps": np.array([7], dtype=np.int64)},
        CONFIG, {3: (0.25, "declared")}, {server_round: {"train-loss": 0.5}},
    )


def test_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    for r in (1, 2, 3):
        _ckpt(r, value=float(r)).save(tmp_path)
    newest = Checkpoint.load(tmp_path)
    prev = torch.load(tmp_path / "checkpoint.prev.pt", weights_only=True)
    assert newest is not None and newest.server_round == 3
    assert prev["server-round"] == 2 and float(prev["arrays"]["w"][0, 0]) == 2.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.prev.pt", "checkpoint.pt"]


def test_a_crash_during_rotation_leaves_the_newest_checkpoint_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _ckpt(1).save(tmp_path)
    real_replace = os.replace

    def dies_before_the_new_one_lands(src: os.PathLike[str], dst: os.PathLike[str]) -> None:
        if Path(dst).name == "checkpoint.pt":
            raise KeyboardInterrupt  # the process dies here
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", dies_before_the_new_one_lands)
    with pytest.raises(KeyboardInterrupt):
        _ckpt(2).save(tmp_path)
    monkeypatch.undo()
    loaded = Checkpoint.load(tmp_path)
    assert loaded is not None and loaded.server_round == 1


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_model_is_never_checkpointed(tmp_path: Path, bad: float) -> None:
    _ckpt(1).save(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    broken = _ckpt(2)
    broken.arrays["w"][1, 2] = bad
    broken.arrays["v"] = np.array([bad, bad, 0.0])
    with pytest.raises(ValueError, match=(
        r"Round 2's model has non-finite values in 'w' \(1 of 6\), 'v' \(2 of 3\); expected "
        r"finite weights\. A non-finite model is never checkpointed: nothing was written"
    )):
        broken.save(tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


@pytest.mark.parametrize(("content", "what"), [
    (b"", r"is empty \(0 bytes\)"),
    (b"not a checkpoint at all", r"\(23 bytes\) is corrupt or truncated"),
    (None, r"\(\d+ bytes\) is corrupt or truncated"),  # None: a real checkpoint cut in half
])
def test_an_unreadable_checkpoint_is_named_with_what_to_do(
    tmp_path: Path, content: bytes | None, what: str
) -> None:
    _ckpt(1).save(tmp_path)
    _ckpt(2).save(tmp_path)
    path = tmp_path / "checkpoint.pt"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if content is None else content)
    with pytest.raises(CheckpointError, match=(
        rf"{path} {what}.*expected a fedshard checkpoint .*cannot resume from it\. Delete it "
        r"to fall back on checkpoint.prev.pt \(Checkpoint.load\(directory, fallback=True\)"
    )):
        Checkpoint.load(tmp_path)


def test_without_a_previous_checkpoint_the_advice_is_to_start_again(tmp_path: Path) -> None:
    _ckpt(1).save(tmp_path)
    (tmp_path / "checkpoint.pt").write_bytes(b"\x00" * 10)
    with pytest.raises(CheckpointError, match=(
        r"\(10 bytes\) is corrupt or truncated .*There is no previous checkpoint to fall back "
        r"on: start the run again with overwrite=true"
    )):
        Checkpoint.load(tmp_path, fallback=True)


def test_fallback_resumes_from_the_previous_checkpoint_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _ckpt(1).save(tmp_path)
    _ckpt(2).save(tmp_path)
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(path.read_bytes()[:100])  # torn by a full disk, say
    with caplog.at_level(logging.WARNING, logger="fedshard.app.checkpoint"):
        loaded = Checkpoint.load(tmp_path, fallback=True)
    assert loaded is not None and loaded.server_round == 1
    assert f"{path} (100 bytes) is corrupt" in caplog.text
    assert "falling back to the previous checkpoint" in caplog.text
    # the newest missing altogether: the same
    path.unlink()
    loaded = Checkpoint.load(tmp_path, fallback=True)
    assert loaded is not None and loaded.server_round == 1
    assert Checkpoint.load(tmp_path) is None  # without fallback: no checkpoint


def test_fallback_with_both_checkpoints_broken_names_both(tmp_path: Path) -> None:
    _ckpt(1).save(tmp_path)
    _ckpt(2).save(tmp_path)
    for name in ("checkpoint.pt", "checkpoint.prev.pt"):
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(CheckpointError, match=(
        rf"Neither checkpoint in {tmp_path} can be read.*checkpoint.pt is empty.*"
        r"checkpoint.prev.pt is empty"
    )):
        Checkpoint.load(tmp_path, fallback=True)
    with pytest.raises(CheckpointError, match=r"checkpoint.pt is empty"):
        Checkpoint.load(tmp_path)  # no fallback: the newest one's error


def _payload(**changes: object) -> dict[str, object]:
    payload: dict[str, object] = {
        "format": 1, "server-round": 2, "arrays": {"w": torch.zeros(2)}, "config": {},
        "capabilities": {1: (0.5, "declared")}, "history": {1: {"loss": 1.0}},
    }
    payload.update(changes)
    return {k: v for k, v in payload.items() if v is not _DROP}


_DROP = object()


@pytest.mark.parametrize(("payload", "problem"), [
    ([1, 2, 3], r"expected a dict with keys \['format', .*found a list"),
    (_payload(format=7, **{"fedshard-version": "9.0"}),
     r"unknown checkpoint format 7 \(written by fedshard 9\.0\); fedshard 0\.1\.0 reads formats "
     r"1, 2: resume it with the fedshard version that wrote it"),
    (_payload(arrays=_DROP, history=_DROP), r"missing key 'arrays'; missing key 'history'"),
    (_payload(**{"server-round": "2"}), r"'server-round' must be an integer >= 0, found '2'"),
    (_payload(arrays={"w": [1.0, 2.0]}), r"'arrays' must map names to tensors"),
    (_payload(arrays={"w": torch.tensor([1.0, float("nan")])}),
     r"non-finite values in 'w' \(1 of 2\)"),
    (_payload(config=[1]), r"'config' must be a dict, found list"),
    (_payload(capabilities={1: 0.5}), r"'capabilities' must map node ids to \(keep ratio"),
    (_payload(history={1: 0.5}), r"'history' must map rounds to dicts"),
])
def test_a_checkpoint_with_wrong_keys_or_types_is_refused(
    tmp_path: Path, payload: object, problem: str
) -> None:
    torch.save(payload, tmp_path / "checkpoint.pt")
    with pytest.raises(CheckpointError, match=(
        rf"{tmp_path / 'checkpoint.pt'} is not a valid fedshard checkpoint: {problem}.*"
        r"The run cannot resume from it\. There is no previous checkpoint"
    )):
        Checkpoint.load(tmp_path)


def test_a_valid_checkpoint_round_trips(tmp_path: Path) -> None:
    _ckpt(4, value=0.5).save(tmp_path)
    loaded = Checkpoint.load(tmp_path)
    assert loaded is not None
    assert loaded.server_round == 4 and loaded.config == CONFIG
    assert loaded.capabilities == {3: (0.25, "declared")}
    assert loaded.history == {4: {"train-loss": 0.5}}
    np.testing.assert_array_equal(loaded.arrays["w"], np.full((2, 3), 0.5, dtype=np.float32))
    assert loaded.arrays["steps"].dtype == np.int64


def test_a_previous_releases_checkpoint_resumes_with_the_settings_added_since_at_default(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A format-1 checkpoint (no version recorded) lacks the settings added since: at their
    defaults they are logged and the run resumes; set otherwise, the refusal names both
    versions and what to do."""
    old_config = {"lr": 0.1, "seed": 3, "removed-setting": 1}
    torch.save(_payload(config=old_config), tmp_path / "checkpoint.pt")
    checkpoint = Checkpoint.load(tmp_path)
    assert checkpoint is not None and checkpoint.format == 1
    assert checkpoint.version == "0.1.0 or earlier"
    defaults = {"lr": 0.05, "seed": 0, "memory-mb": 0, "low-memory": False}
    now = {"lr": 0.1, "seed": 3, "memory-mb": 0, "low-memory": False}
    with caplog.at_level(logging.INFO, logger="fedshard.app.checkpoint"):
        checkpoint.check_config(now, defaults=defaults)
    assert ("(written by fedshard 0.1.0 or earlier, checkpoint format 1; this is fedshard "
            "0.1.0) has no low-memory, memory-mb: they take this version's defaults "
            "(low-memory=False, memory-mb=0)") in caplog.text
    assert "holds settings this version does not have: removed-setting=1" in caplog.text
    with pytest.raises(CheckpointError, match=(
            r"Cannot resume: the run config differs from the checkpoint's \(written by fedshard "
            r"0\.1\.0 or earlier, checkpoint format 1; this is fedshard 0\.1\.0\) \(memory-mb: "
            r"900 \(the checkpoint's fedshard had no memory-mb; its default is 0\)\)\. Resume "
            r"with the checkpoint's config \(settings it did not have at their defaults\)")):
        checkpoint.check_config({**now, "memory-mb": 900}, defaults=defaults)
    with pytest.raises(CheckpointError, match=r"\(lr: 0\.1 -> 0\.2\)"):
        checkpoint.check_config({**now, "lr": 0.2}, defaults=defaults)


def test_a_saved_checkpoint_records_its_format_and_version(tmp_path: Path) -> None:
    _ckpt(1).save(tmp_path)
    payload = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert payload["format"] == 2 and payload["fedshard-version"] == "0.1.0"
    loaded = Checkpoint.load(tmp_path)
    assert loaded is not None and (loaded.format, loaded.version) == (2, "0.1.0")
