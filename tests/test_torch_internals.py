"""The private parts of torch the library reads, pinned: where a module keeps its hooks (the
step pool refuses to pool a model with hooks, fedshard.client.train.fast.pool; a kept
sub-model is loaded by a plain copy only when no module has state-dict hooks or its own
loading, fedshard.client.shard). If torch moves them, these tests fail and say what to
change."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from fedshard.client.train.fast.pool import MODULE_HOOKS, model_signature

ROOT = Path(__file__).resolve().parents[1]


def test_module_hook_attributes_exist_and_hold_the_hooks() -> None:
    m = nn.Linear(2, 2)
    missing = [name for name in MODULE_HOOKS if not isinstance(getattr(m, name, None), dict)]
    assert not missing, (
        f"torch {torch.__version__}: nn.Module no longer keeps its hooks in {missing}; update "
        "MODULE_HOOKS in fedshard/client/train/fast/pool.py (the step pool must see hooks)")
    m.register_forward_hook(lambda *a: None)
    assert m._forward_hooks and model_signature(m, _cfg()) is None  # a hooked model: unpooled


def test_state_dict_hook_tables_and_module_loading_are_where_the_copy_looks() -> None:
    from fedshard.client.shard import _PLAIN_LOADS, STATE_DICT_HOOKS

    m = nn.BatchNorm1d(3)
    missing = [name for name in STATE_DICT_HOOKS if not isinstance(getattr(m, name, None), dict)]
    assert not missing, (
        f"torch {torch.__version__}: nn.Module no longer keeps its state-dict hooks in "
        f"{missing}; update STATE_DICT_HOOKS in fedshard/client/shard.py")
    m.register_load_state_dict_pre_hook(lambda *a: None)
    m.register_load_state_dict_post_hook(lambda *a: None)
    m.register_state_dict_pre_hook(lambda *a: None)
    m.register_state_dict_post_hook(lambda *a: None)
    assert all(getattr(m, name) for name in STATE_DICT_HOOKS)
    assert nn.Linear(2, 2)._load_from_state_dict.__func__ in _PLAIN_LOADS  # type: ignore[attr-defined]
    assert type(m)._load_from_state_dict in _PLAIN_LOADS  # the batch norms' own loading
    assert nn.BatchNorm1d._load_from_state_dict is nn.BatchNorm3d._load_from_state_dict


def test_the_library_reads_no_other_private_torch_name() -> None:
    """``torch.<...>._name`` and ``nn.modules.<...>._Name`` nowhere in fedshard/ (public
    classes instead: BATCH_NORMS, the dropout layers)."""
    pattern = re.compile(r"torch(\.[A-Za-z0-9]+)*\._[A-Za-z]|nn\.modules\.\w+\._")
    found = [f"{p.relative_to(ROOT)}:{i}" for p in (ROOT / "fedshard").rglob("*.py")
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == []


def _cfg():
    from fedshard.client.train import TrainConfig

    return TrainConfig()
