"""load_partition / load_test_set: registry, argument checks, determinism and caching."""

from __future__ import annotations

import numpy as np
import pytest
from fakedata import write_cifar10

from fedshard.data import (
    DATASETS,
    DatasetInfo,
    clear_cache,
    dataset_info,
    image_files,
    load_partition,
    load_test_set,
)


@pytest.fixture(autouse=True)
def _fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDSHARD_CACHE_DIR", str(tmp_path / "cache"))
    clear_cache()
    yield
    clear_cache()


@pytest.fixture
def cifar_root(tmp_path):
    write_cifar10(tmp_path, 40, 10, np.random.default_rng(0))
    return tmp_path


def test_registry_matches_the_paper_setup():
    assert DATASETS == ("fashion-mnist", "cifar10", "cifar100", "tinyimagenet", "shakespeare")
    expected = {
        "fashion-mnist": (10, 1, 28, "image", "dirichlet", 1.0),
        "cifar10": (10, 3, 32, "image", "dirichlet", 1.0),
        "cifar100": (100, 3, 32, "image", "pachinko", 1.0),
        "tinyimagenet": (200, 3, 64, "image", "dirichlet", 10.0),
        "shakespeare": (81, 0, 0, "next-char", "natural", None),
    }
    for name, values in expected.items():
        info = dataset_info(name)
        assert isinstance(info, DatasetInfo) and info.name == name
        got = (
            info.num_classes,
            info.in_channels,
            info.image_size,
            info.task,
            info.partition,
            info.default_alpha,
        )
        assert got == values
    assert dataset_info("cifar100").default_alpha_fine == 10.0


def test_unknown_name_is_rejected():
    with pytest.raises(ValueError, match=r"Unknown data set 'mnist': expected one of \("):
        dataset_info("mnist")
    with pytest.raises(ValueError, match=r"Unknown data set 'cifar'"):
        load_partition("cifar", 0, 2)


@pytest.mark.parametrize(
    ("pid", "k", "error", "match"),
    [
        (2, 2, ValueError, r"partition_id=2 with num_partitions=2: expected .*0 <= partition_id"),
        (-1, 2, ValueError, r"partition_id=-1"),
        (0, 0, ValueError, r"num_partitions=0"),
        (0.0, 2, TypeError, r"partition_id must be an int, got float"),
    ],
)
def test_partition_arguments_are_checked(cifar_root, pid, k, error, match):
    with pytest.raises(error, match=match):
        load_partition("cifar10", pid, k, data_dir=cifar_root)


def test_alpha_fine_only_for_pachinko(cifar_root):
    with pytest.raises(
        ValueError, match=r"alpha_fine=10.0 applies only to .*cifar100, not cifar10"
    ):
        load_partition("cifar10", 0, 2, data_dir=cifar_root, alpha_fine=10.0)


def test_too_many_partitions_is_an_error(cifar_root):
    with pytest.raises(ValueError, match=r"num_partitions=201: expected between 1 and .*\(200\)"):
        load_partition("cifar10", 0, 201, data_dir=cifar_root)


def test_split_is_deterministic_and_depends_on_seed_and_alpha(cifar_root):
    def labels(**kwargs):
        return [
            tuple(load_partition("cifar10", p, 5, data_dir=cifar_root, **kwargs).targets)
            for p in range(5)
        ]

    first = labels(seed=1)
    clear_cache()
    assert labels(seed=1) == first  # recomputed from scratch: same split
    assert labels(seed=2) != first
    assert labels(seed=1, alpha=100.0) != first
    assert labels() == labels(alpha=1.0)  # the paper's default for cifar10


def test_files_are_read_once_per_process(cifar_root, monkeypatch):
    calls = []
    real = image_files.read_split

    def counting(name, folder, split):
        calls.append(split)
        return real(name, folder, split)

    monkeypatch.setattr(image_files, "read_split", counting)
    for p in range(8):
        load_partition("cifar10", p, 8, data_dir=cifar_root)
    assert calls == ["train"]


def test_test_set_subset_is_evenly_spaced(cifar_root):
    full = load_test_set("cifar10", data_dir=cifar_root)
    sub = load_test_set("cifar10", data_dir=cifar_root, max_examples=4)
    assert len(full) == 10 and len(sub) == 4
    # linspace(0, 9, 4) rounded: 0, 3, 6, 9
    assert sub.targets.tolist() == full.targets[[0, 3, 6, 9]].tolist()
    assert len(load_test_set("cifar10", data_dir=cifar_root, max_examples=0)) == 10
