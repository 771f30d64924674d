"""The server's device paths (SVD and rebuild through torch on a device), run on the CPU.

CI has no GPU: the torch path is forced with device "cpu" and compared with the numpy path;
the same code runs with "cuda" on a GPU (tests/client/train/fast/test_cuda.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedshard.app.task import resolve_device
from fedshard.spectral.aggregate import TermUpdate, rebuild_weight, term_means
from fedshard.spectral.decompose import layer_spectrum

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("held", [[1, 4], [0, 1, 2, 3, 5]], ids=["rank-2h", "full-sum"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_torch_rebuild_equals_numpy_rebuild(device: str, held: list[int], dtype: type) -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 3, 2, 2)).astype(dtype)
    up = TermUpdate(1.0, np.array(held), rng.standard_normal((6, len(held))).astype(dtype),
                    rng.standard_normal((12, len(held))).astype(dtype))
    want = rebuild_weight(layer_spectrum(w), *term_means(layer_spectrum(w), [up]))
    spec = layer_spectrum(w, device)
    got = rebuild_weight(spec, *term_means(spec, [up]), device=device)
    assert got.dtype == w.dtype and got.shape == w.shape
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(got, want, rtol=0, atol=tol)


def test_resolve_device() -> None:
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda:0" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match=r"device 'cuda:1' was asked for, but torch sees"):
            resolve_device("cuda:1")
