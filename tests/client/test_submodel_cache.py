"""handle_train with a SubmodelCache (what the in-process engine passes): the same replies, bit
for bit, as without one, with the model copied once per sub-model shape, not once per node."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from flower_grid import InProcessGrid
from flwr.app import ArrayRecord, ConfigRecord, Context, Message
from flwr.clientapp import ClientApp
from torch import nn
from torch.utils.data import TensorDataset

import fedshard.client.shard as shard_module
from fedshard import Cohort, LocalTraining, NodePolicy, Sharding, SpectralSharding, handle_query
from fedshard.client import SubmodelCache, handle_train
from fedshard.client.train.fast import FastOptions


def net() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 8),
                             nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))


def node_data(seed: int, n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def round_messages(ratios: list[float], method: str = "collective") -> list[Message]:
    """One round's train messages for nodes declaring ``ratios``."""
    app = ClientApp()

    @app.query()
    def _q(msg: Message, context: Context) -> Message:
        return handle_query(msg, float(context.node_config["keep"]),
                            str(context.node_config["key"]))

    s = SpectralSharding(sharded_layers=["3", "5"], sharding=Sharding(method=method),
                         training=LocalTraining(lr=0.05), seed=3,
                         cohort=Cohort(min_train_nodes=len(ratios),
                                       min_available_nodes=len(ratios)),
                         nodes=NodePolicy(query_timeout=5, node_wait_timeout=5))
    s.num_rounds = 2
    grid = InProcessGrid(app, [{"keep": r, "key": i} for i, r in enumerate(ratios)])
    return list(s.configure_train(1, ArrayRecord(net().state_dict()), ConfigRecord(), grid))


def _content(reply: Message) -> tuple[dict[str, bytes], dict[str, Any]]:
    arrays = {k: a.data for k, a in reply.content.array_records["arrays"].items()}
    return arrays, dict(reply.content.metric_records["metrics"])


def _counting_builds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    build = shard_module.build_submodel

    def counted(*args: Any, **kwargs: Any) -> nn.Module:
        calls.append(1)
        return build(*args, **kwargs)

    monkeypatch.setattr(shard_module, "build_submodel", counted)
    return calls


@pytest.mark.parametrize("method", ["collective", "none"])
def test_kept_sub_models_give_the_same_replies_bit_for_bit(
        monkeypatch: pytest.MonkeyPatch, method: str) -> None:
    ratios = [0.25, 0.5, 0.25, 0.5, 0.25] if method != "none" else [1.0] * 4
    messages = round_messages(ratios, method)
    model = net()
    plain = [handle_train(m, model, node_data(i, 20 + 7 * i)) for i, m in enumerate(messages)]
    builds = _counting_builds(monkeypatch)
    cache = SubmodelCache(model)
    kept = [handle_train(m, model, node_data(i, 20 + 7 * i), submodels=cache)
            for i, m in enumerate(messages)]
    assert [_content(r) for r in kept] == [_content(r) for r in plain]
    assert len(builds) == len(set(ratios))  # one copy of the model per shape
    assert len(cache) == len(set(ratios))
    for name, p in net().state_dict().items():  # the caller's model is not modified
        assert torch.equal(model.state_dict()[name], p)


def test_a_node_whose_training_fails_leaves_nothing_behind(
        monkeypatch: pytest.MonkeyPatch) -> None:
    messages = round_messages([0.5, 0.5, 0.5])
    model = net()
    cache = SubmodelCache(model)
    with pytest.raises(ValueError, match="no batches"):
        handle_train(messages[0], model, node_data(0, 0), submodels=cache)
    assert len(cache) == 0  # a sub-model whose training raised is not kept
    got = handle_train(messages[1], model, node_data(1, 30), submodels=cache)
    want = handle_train(messages[1], model, node_data(1, 30))
    assert _content(got) == _content(want)


def test_a_sub_model_trained_with_a_fast_option_is_not_kept() -> None:
    messages = round_messages([0.5, 0.5])
    model = net()
    cache = SubmodelCache(model)
    handle_train(messages[0], model, node_data(0, 20), submodels=cache,
                 fast=FastOptions(pad_terms=2))
    assert len(cache) == 0
    handle_train(messages[1], model, node_data(1, 20), submodels=cache)
    assert len(cache) == 1


def test_at_most_max_shapes_sub_models_are_kept() -> None:
    messages = round_messages([0.2, 0.4, 0.6, 0.8])
    model = net()
    cache = SubmodelCache(model, max_shapes=2)
    replies = [handle_train(m, model, node_data(i, 16), submodels=cache)
               for i, m in enumerate(messages)]
    assert len(cache) == 2 and all(not r.has_error() for r in replies)


def test_misuse_is_refused_with_what_to_do() -> None:
    msg = round_messages([0.5])[0]
    model = net()
    with pytest.raises(ValueError, match="another model"):
        handle_train(msg, model, node_data(0, 8), submodels=SubmodelCache(net()))
    with pytest.raises(ValueError, match="max_shapes=0"):
        SubmodelCache(model, max_shapes=0)
    cache = SubmodelCache(model)
    cache.give(net())  # not lent by this cache: ignored
    assert len(cache) == 0
    assert np.isfinite(float(handle_train(msg, model, node_data(0, 8), submodels=cache)
                             .content.metric_records["metrics"]["train-loss"]))


def _loaded_by_load_state_dict(model: nn.Module, message: Message) -> nn.Module:
    """The sub-model ``message`` describes, built afresh and loaded by ``load_state_dict``."""
    return shard_module.submodel_from_record(model, message.content.array_records["arrays"])[0]


def test_a_kept_sub_model_is_loaded_as_load_state_dict_loads_a_new_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A kept sub-model takes the next node's values by a copy from the received bytes: every
    parameter and buffer equals, bit for bit, what a new sub-model loaded by
    ``load_state_dict`` holds, and ``load_state_dict`` is not called for it."""
    messages = round_messages([0.5, 0.5, 0.5])
    model = net()
    cache = SubmodelCache(model)
    record = messages[0].content.array_records["arrays"]
    first, _ = shard_module.submodel_from_record(model, record, cache)
    with torch.no_grad():  # as training leaves it: every value moved
        for t in first.state_dict(keep_vars=True).values():
            t.add_(1.0)
    cache.give(first)
    loads: list[int] = []
    original = nn.Module.load_state_dict

    def counted(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        loads.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(nn.Module, "load_state_dict", counted)
    kept, _ = shard_module.submodel_from_record(
        model, messages[1].content.array_records["arrays"], cache)
    assert kept is first and loads == []
    monkeypatch.setattr(nn.Module, "load_state_dict", original)
    fresh = _loaded_by_load_state_dict(model, messages[1])
    assert kept.state_dict().keys() == fresh.state_dict().keys()
    for (name, a), b in zip(kept.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_a_kept_sub_model_with_state_dict_hooks_is_loaded_by_load_state_dict() -> None:
    """A module whose loading a hook changes is left to ``load_state_dict``: the hook runs,
    and the values are still the received ones."""
    messages = round_messages([0.5, 0.5])
    model = net()
    cache = SubmodelCache(model)
    first, _ = shard_module.submodel_from_record(
        model, messages[0].content.array_records["arrays"], cache)
    seen: list[str] = []
    first[1].register_load_state_dict_pre_hook(lambda module, state, prefix, *rest:
                                               seen.append(prefix))
    cache.give(first)
    kept, _ = shard_module.submodel_from_record(
        model, messages[1].content.array_records["arrays"], cache)
    assert kept is first and seen == ["1."]
    fresh = _loaded_by_load_state_dict(model, messages[1])
    for (name, a), b in zip(kept.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_batch_norm_buffers_are_copied_into_a_kept_sub_model() -> None:
    """Batch-norm running statistics and counters (int64) reach a kept sub-model as
    ``load_state_dict`` would put them there."""
    from fedshard.client.shard import _copy_into

    def bn_net() -> nn.Module:
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))

    target, source = bn_net(), bn_net()
    with torch.no_grad():
        source[1].running_mean.uniform_()
        source[1].num_batches_tracked.fill_(7)
    state = {k: v.numpy().copy() for k, v in source.state_dict().items()}
    for view in state.values():
        view.setflags(write=False)  # as the received bytes are
    assert _copy_into(target, state)
    for (name, a), b in zip(target.state_dict().items(), source.state_dict().values(),
                            strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert not _copy_into(target, {k: v for k, v in state.items() if k != "1.running_var"})
