"""Transposed convolutions as spectral layers, against torch's dense layers: the same map in
float64, the dense round trip, the best rank-n approximation (a numpy SVD of the weight's
matrix view), factor gradients from the dense weight's gradient by the chain rule, and the
default layer selection of a model with a transposed-conv decoder."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fedshard.spectral import (
    LayerFactors,
    SpectralConvTranspose1d,
    SpectralConvTranspose2d,
    SpectralConvTranspose3d,
    build_submodel,
    check_shardable,
    shard_model,
    sharded_layer_names,
    sharding_budget,
)

CASES = [
    (SpectralConvTranspose1d, lambda: nn.ConvTranspose1d(6, 5, 4, stride=3, padding=1,
                                                         output_padding=2, dilation=2),
     (3, 6, 7)),
    (SpectralConvTranspose2d, lambda: nn.ConvTranspose2d(6, 5, (3, 2), stride=(2, 1),
                                                         padding=(1, 0), output_padding=(1, 0)),
     (3, 6, 5, 4)),
    (SpectralConvTranspose2d, lambda: nn.ConvTranspose2d(3, 7, 4, stride=2, bias=False),
     (2, 3, 4, 4)),
    (SpectralConvTranspose3d, lambda: nn.ConvTranspose3d(4, 3, 2, stride=2, padding=1),
     (2, 4, 3, 3, 2)),
]


@pytest.mark.parametrize("cls,make,shape", CASES)
def test_the_factorized_layer_is_the_dense_layer_in_float64(cls, make, shape) -> None:
    torch.manual_seed(0)
    dense = make().double()
    layer = cls.from_dense(dense)
    x = torch.randn(*shape, dtype=torch.float64)
    assert layer.rank == min(dense.weight.shape[0], dense.weight[0].numel())
    torch.testing.assert_close(layer(x), dense(x), rtol=0, atol=1e-12)
    back = layer.to_dense()
    assert type(back) is type(dense)
    torch.testing.assert_close(back.weight, dense.weight, rtol=0, atol=1e-12)
    if dense.bias is not None:
        torch.testing.assert_close(back.bias, dense.bias, rtol=0, atol=0)
    else:
        assert back.bias is None and layer.bias is None
    torch.testing.assert_close(back(x), dense(x), rtol=0, atol=1e-12)
    assert list(layer.state_dict()) == (["u", "v", "bias", "omega"] if dense.bias is not None
                                        else ["u", "v", "omega"])


def test_output_size_picks_the_output_padding_as_the_dense_layer_does() -> None:
    dense = nn.ConvTranspose2d(6, 5, 3, stride=2, padding=1).double()
    layer = SpectralConvTranspose2d.from_dense(dense)
    x = torch.randn(1, 6, 4, 4, dtype=torch.float64)
    for size in ([7, 7], [8, 8], [7, 8]):
        out = layer(x, output_size=size)
        assert out.shape[-2:] == tuple(size)
        torch.testing.assert_close(out, dense(x, output_size=size), rtol=0, atol=1e-12)


def test_top_n_terms_are_the_best_rank_n_approximation_of_the_matrix_view() -> None:
    # W (c_in, c_out, k, k) viewed as (c_in, c_out·k·k); numpy's SVD gives the best rank-n W
    torch.manual_seed(1)
    dense = nn.ConvTranspose2d(8, 6, 3, stride=2).double()
    n = 3
    sub, _ = shard_model(nn.Sequential(dense), {"0": range(n)},
                         {"0": torch.ones(n, dtype=torch.float64)})
    w = dense.weight.detach().numpy()
    u, s, vt = np.linalg.svd(w.reshape(8, -1), full_matrices=False)
    best = nn.ConvTranspose2d(8, 6, 3, stride=2).double()
    with torch.no_grad():
        best.weight.copy_(torch.from_numpy(((u[:, :n] * s[:n]) @ vt[:n]).reshape(w.shape)))
        best.bias.copy_(dense.bias)
    x = torch.randn(2, 8, 5, 5, dtype=torch.float64)
    torch.testing.assert_close(sub(x), best(x), rtol=0, atol=1e-12)


def test_factor_gradients_follow_from_the_dense_weights_gradient() -> None:
    # W = U Ω Vᵀ (matrix view): dL/dU = G V Ω and dL/dV = Gᵀ U Ω with G = dL/dW
    torch.manual_seed(2)
    u = torch.randn(5, 3, dtype=torch.float64)
    v = torch.randn(4 * 9, 3, dtype=torch.float64)
    omega = torch.tensor([0.5, 2.0, 1.5], dtype=torch.float64)
    template = nn.ConvTranspose2d(5, 4, 3, stride=2, padding=1).double()
    layer = SpectralConvTranspose2d.from_factors(template, u, v, omega)
    dense = nn.ConvTranspose2d(5, 4, 3, stride=2, padding=1).double()
    with torch.no_grad():
        dense.weight.copy_(((u * omega) @ v.T).reshape(dense.weight.shape))
        dense.bias.copy_(template.bias)
    x = torch.randn(2, 5, 6, 6, dtype=torch.float64)
    target = torch.randn(2, 4, 11, 11, dtype=torch.float64)
    ((layer(x) - target) ** 2).sum().backward()
    ((dense(x) - target) ** 2).sum().backward()
    g = dense.weight.grad.reshape(5, -1)
    torch.testing.assert_close(layer.u.grad, g @ v * omega, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.v.grad, g.T @ u * omega, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.bias.grad, dense.bias.grad, rtol=1e-12, atol=1e-12)
    assert layer.omega.grad is None


class _Autoencoder(nn.Module):
    """A conv encoder and a transposed-conv decoder (a VAE's shape, without the sampling)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Conv2d(1, 8, 3, stride=2, padding=1), nn.ReLU(),
                                     nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU())
        self.decoder = nn.Sequential(
            nn.ConvTranspose2d(16, 8, 3, stride=2, padding=1, output_padding=1), nn.ReLU(),
            nn.ConvTranspose2d(8, 1, 3, stride=2, padding=1, output_padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


def test_the_default_selection_shards_a_transposed_conv_decoder_but_the_last_layer() -> None:
    model = _Autoencoder()
    x = torch.zeros(1, 1, 28, 28)
    names = sharded_layer_names(model, example_input=x)
    assert names == ["encoder.2", "decoder.0"]
    sub, _ = shard_model(model, {n: range(4) for n in names},
                         {n: torch.ones(4) for n in names})
    assert isinstance(sub.decoder[0], SpectralConvTranspose2d)
    assert sub(x).shape == model(x).shape == (1, 1, 28, 28)
    budget = sharding_budget(model, names, [0.25], example_input=x)
    # the decoder's transposed conv is counted as sharded, not as a dense layer left out
    assert "decoder.0" not in {u.name for u in budget.unsharded}
    assert budget.at(0.25).forward_flops < budget.dense_flops


def test_grouped_transposed_convs_are_refused_by_name() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ConvTranspose2d(4, 4, 3, groups=2),
                          nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"'1' \(ConvTranspose2d\) has groups=2"):
        check_shardable(model, ["1"])
    with pytest.raises(ValueError, match=r"expects bias of shape \(4,\)"):
        SpectralConvTranspose2d(torch.ones(3, 1), torch.ones(36, 1), torch.ones(1),
                                torch.ones(3), out_channels=4, kernel_size=3)
    with pytest.raises(ValueError, match=r"u \(3, n\), v \(36, n\)"):
        build_submodel(nn.Sequential(nn.ConvTranspose2d(3, 4, 3)),
                       {"0": LayerFactors(torch.ones(3, 1), torch.ones(35, 1), torch.ones(1))})


def test_one_round_of_a_transposed_conv_decoder_rebuilds_the_trained_weight() -> None:
    """The server plans the terms of a ConvTranspose2d, a node trains them in its own loop
    (MSE, the VAE's shape) and replies; at keep ratio 1 with one node, the server's new
    weight is the trained layer's own dense weight (its ``to_dense``), in the dense layer's
    (c_in, c_out, k, k) layout."""
    from flower_grid import InProcessGrid
    from flwr.app import ArrayRecord, ConfigRecord
    from flwr.clientapp import ClientApp

    from fedshard import (
        Cohort,
        LocalTraining,
        NodePolicy,
        Sharding,
        SpectralSharding,
        handle_query,
        receive,
    )

    torch.manual_seed(3)
    model = _Autoencoder()
    app = ClientApp()

    @app.query()
    def _q(msg, context):  # type: ignore[no-untyped-def]
        return handle_query(msg, 1.0)

    strategy = SpectralSharding(sharded_layers=["encoder.2", "decoder.0"],
                                sharding=Sharding(method="unbiased"),
                                training=LocalTraining(lr=0.05), seed=3,
                                cohort=Cohort(min_train_nodes=1, min_available_nodes=1),
                                nodes=NodePolicy(query_timeout=5, node_wait_timeout=5))
    strategy.num_rounds = 1
    grid = InProcessGrid(app, [{}])
    msg = next(iter(strategy.configure_train(1, ArrayRecord(model.state_dict()),
                                             ConfigRecord(), grid)))
    trained = []

    @app.train()
    def _train(msg, context):  # type: ignore[no-untyped-def]
        shard = receive(msg, model)
        assert isinstance(shard.model.decoder[0], SpectralConvTranspose2d)
        opt = shard.optimizer()
        x = torch.rand(6, 1, 28, 28)
        for _ in range(3):
            loss = ((shard.model(x) - x) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        trained.append(shard.model.decoder[0].to_dense().weight.detach())
        return shard.reply(num_examples=6)

    reply = next(iter(grid.send_and_receive([msg])))
    assert not reply.has_error(), reply.error.reason
    arrays, _ = strategy.aggregate_train(1, [reply])
    assert arrays is not None
    new = arrays.to_torch_state_dict()
    assert new["decoder.0.weight"].shape == (16, 8, 3, 3)
    assert not torch.allclose(new["decoder.0.weight"], model.decoder[0].weight)
    torch.testing.assert_close(new["decoder.0.weight"], trained[0], rtol=1e-5, atol=1e-6)


def test_opacus_per_example_gradients_match_one_example_at_a_time() -> None:
    opacus = pytest.importorskip("opacus")
    torch.manual_seed(4)
    dense = nn.ConvTranspose2d(4, 3, 3, stride=2).double()
    layer = nn.Sequential(SpectralConvTranspose2d.from_dense(dense, indices=[0, 2]))
    x = torch.randn(3, 4, 5, 5, dtype=torch.float64)
    opacus.GradSampleModule(layer, loss_reduction="sum")(x).pow(2).sum().backward()
    for name, param in layer.named_parameters():
        if not param.requires_grad:
            continue
        one_by_one = []
        for i in range(3):
            alone = nn.Sequential(SpectralConvTranspose2d.from_dense(dense, indices=[0, 2]))
            alone(x[i:i + 1]).pow(2).sum().backward()
            one_by_one.append(dict(alone.named_parameters())[name].grad)
        torch.testing.assert_close(param.grad_sample, torch.stack(one_by_one), rtol=1e-12,
                                   atol=1e-12)


def test_low_memory_mode_gives_a_transposed_decoder_the_plain_gradients() -> None:
    from fedshard.spectral import low_memory

    torch.manual_seed(5)
    model = _Autoencoder().double()
    names = sharded_layer_names(model)
    sub, _ = shard_model(model, {n: range(3) for n in names},
                         {n: torch.full((3,), 1.5, dtype=torch.float64) for n in names})
    x = torch.rand(2, 1, 28, 28, dtype=torch.float64)
    ((sub(x) - x) ** 2).sum().backward()
    plain = {k: p.grad.clone() for k, p in sub.named_parameters() if p.grad is not None}
    sub.zero_grad()
    with low_memory(sub):
        ((sub(x) - x) ** 2).sum().backward()
    for k, g in plain.items():
        torch.testing.assert_close(dict(sub.named_parameters())[k].grad, g, rtol=1e-10,
                                   atol=0)
