"""LEAF Shakespeare: vocabulary, next-character samples, one client per role."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fakedata import leaf_samples, write_leaf_json

from fedshard.data import (
    VOCAB_SIZE,
    DataNotFoundError,
    clear_cache,
    dataset_info,
    load_partition,
    load_test_set,
)
from fedshard.data.shakespeare import LEAF_LETTERS, decode, encode

# LEAF, models/utils/language_utils.py (TalwalkarLab/leaf): ALL_LETTERS.
LEAF_ALL_LETTERS = (
    "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
)

ROLES = {
    "B_ROLE": "To be, or not to be: that is the question! Whether 'tis nobler in the mind "
    "to suffer the slings and arrows of outrageous fortune.",
    "A_ROLE": "Now is the winter of our discontent made glorious summer by this sun of York; "
    "and all the clouds that lour'd upon our house.",
    "C_ROLE": "Friends, Romans, countrymen, lend me your ears; I come to bury Caesar, "
    "not to praise him. The evil that men do lives after them|",  # '|' is not in LEAF
}


@pytest.fixture(autouse=True)
def _fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDSHARD_CACHE_DIR", str(tmp_path / "cache"))
    clear_cache()
    yield
    clear_cache()


@pytest.fixture
def leaf_root(tmp_path):
    # Two train files (LEAF splits users over files), test text = the role's last part.
    train = tmp_path / "shakespeare" / "data" / "train"
    write_leaf_json(train / "part0.json", {k: ROLES[k][:110] for k in ("B_ROLE", "A_ROLE")})
    write_leaf_json(train / "part1.json", {"C_ROLE": ROLES["C_ROLE"][:110]})
    write_leaf_json(
        tmp_path / "shakespeare" / "data" / "test" / "all.json",
        {k: v[110 - 80 :] for k, v in ROLES.items()},
    )
    return tmp_path


def _expected_indices(text: str) -> list[int]:
    return [LEAF_ALL_LETTERS.index(c) if c in LEAF_ALL_LETTERS else 80 for c in text]


def test_vocabulary_is_leafs_plus_unknown():
    assert LEAF_LETTERS == LEAF_ALL_LETTERS and len(LEAF_LETTERS) == 80
    assert VOCAB_SIZE == 81 == dataset_info("shakespeare").num_classes
    text = "Hello, Ünïcode|world}\n"
    assert encode(text).tolist() == _expected_indices(text)
    assert decode(encode("To be}")) == "To be}"
    assert decode([80]) == "\ufffd"


def test_client_is_one_role_with_shifted_targets(leaf_root):
    roles = sorted(ROLES)  # partition i is the i-th role in sorted order
    for pid, role in enumerate(roles):
        data = load_partition("shakespeare", pid, 3, data_dir=leaf_root)
        text = ROLES[role][:110]
        assert len(data) == len(leaf_samples(text)["x"]) == 30
        for i in (0, 17, 29):
            x, y = data[i]
            assert x.dtype == torch.int64 and x.shape == (80,) and y.shape == (80,)
            # y is the next character at every position; its last entry is LEAF's y.
            assert x.tolist() == _expected_indices(text[i : i + 80])
            assert y.tolist() == _expected_indices(text[i + 1 : i + 81])


def test_test_set_is_every_roles_test_samples(leaf_root):
    test = load_test_set("shakespeare", data_dir=leaf_root)
    assert len(test) == sum(len(v) - 110 for v in ROLES.values())
    first_x, first_y = test[0]  # roles in sorted order: A_ROLE first
    assert first_x.tolist() == _expected_indices(ROLES["A_ROLE"][30:110])
    assert first_y.tolist() == _expected_indices(ROLES["A_ROLE"][31:111])
    last_x, last_y = test[len(test) - 1]
    assert last_y[-1].item() == 80  # C_ROLE ends in '|', outside LEAF's alphabet
    subset = load_test_set("shakespeare", data_dir=leaf_root, max_examples=4)
    assert len(subset) == 4
    assert subset[3][0].tolist() == last_x.tolist()  # evenly spaced, ends at the last sample


def test_fewer_clients_than_roles_uses_the_first_roles(leaf_root):
    data = load_partition("shakespeare", 1, 2, data_dir=leaf_root)
    assert data[0][0].tolist() == _expected_indices(ROLES["B_ROLE"][:80])


def test_more_clients_than_roles_is_an_error(leaf_root):
    with pytest.raises(ValueError, match=r"num_partitions=4: the LEAF files hold only 3 speaking"):
        load_partition("shakespeare", 0, 4, data_dir=leaf_root)


def test_alpha_is_rejected_for_the_natural_split(leaf_root):
    with pytest.raises(ValueError, match=r"alpha=1.0: shakespeare is split naturally"):
        load_partition("shakespeare", 0, 3, data_dir=leaf_root, alpha=1.0)


def test_flat_layout_is_accepted(tmp_path):
    write_leaf_json(tmp_path / "shakespeare" / "train" / "a.json", {"R": ROLES["A_ROLE"]})
    assert len(load_partition("shakespeare", 0, 1, data_dir=tmp_path)) == len(ROLES["A_ROLE"]) - 80


def test_user_in_two_files_is_an_error(tmp_path):
    folder = tmp_path / "shakespeare" / "train"
    write_leaf_json(folder / "a.json", {"R": ROLES["A_ROLE"]})
    write_leaf_json(folder / "b.json", {"R": ROLES["B_ROLE"]})
    with pytest.raises(ValueError, match=r"b.json: user 'R' also appears in .*a.json"):
        load_partition("shakespeare", 0, 1, data_dir=tmp_path)


def test_malformed_samples_are_reported(tmp_path):
    folder = tmp_path / "shakespeare" / "train"
    folder.mkdir(parents=True)
    (folder / "a.json").write_text(
        '{"users": ["R"], "user_data": {"R": {"x": ["abc", "ab"], "y": ["d", "c"]}}}'
    )
    with pytest.raises(ValueError, match=r"user 'R' must have x strings of one length"):
        load_partition("shakespeare", 0, 1, data_dir=tmp_path)


def test_missing_leaf_files_explain_preprocessing(tmp_path):
    with pytest.raises(DataNotFoundError,
                       match=r"python -m fedshard_lab.shakespeare_build .*preprocess.sh"):
        load_test_set("shakespeare", data_dir=tmp_path)


def test_sample_windows_overlap_like_leaf(leaf_root):
    # Independent of fedshard: LEAF's consecutive windows overlap by 79 characters, so the
    # inputs of sample i + 1 are the targets of sample i.
    data = load_partition("shakespeare", 0, 3, data_dir=leaf_root)
    for i in range(len(data) - 1):
        assert np.array_equal(data[i][1].numpy(), data[i + 1][0].numpy())
