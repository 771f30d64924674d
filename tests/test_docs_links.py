"""The Markdown pages work both on GitHub and in the Sphinx site (MyST).

Every relative link and image of README.md, docs/**/*.md and the examples' READMEs points at a
file that exists, and every ``#anchor`` at a heading of the page it names, with the slug
GitHub and MyST both give it (MyST only for headings down to ``myst_heading_anchors``, 3
levels). Nothing that only Sphinx renders appears outside code: a ``{py:func}`` role or a
``path:`` link shows as raw text, or leads nowhere, on GitHub. A few hundred links, checked in
well under a second, without building the site (``tests/test_docs.py`` builds it).
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted({ROOT / "README.md", *DOCS.rglob("*.md"), *ROOT.glob("examples/*/README.md")}
               - set((DOCS / "_build").rglob("*.md")))
#: MyST's ``myst_heading_anchors`` (docs/conf.py): deeper headings get no anchor in Sphinx.
SPHINX_ANCHOR_LEVELS = 3

_FENCE = re.compile(r"^( {0,3})(`{3,}|~{3,})")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
_ROLE = re.compile(r"\{[a-z][\w:-]*\}`")
_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*):")
_WEB_SCHEMES = {"http", "https", "mailto"}
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def without_fences(text: str) -> str:
    """``text`` with its fenced code blocks emptied (their lines kept)."""
    lines, fence = [], None
    for line in text.splitlines():
        found = _FENCE.match(line)
        if fence is None and found:
            fence = found.group(2)[0] * len(found.group(2))
            lines.append("")
        elif fence is not None:
            if line.strip().startswith(fence) and set(line.strip()) == {fence[0]}:
                fence = None
            lines.append("")
        else:
            lines.append(line)
    return "\n".join(lines)


def prose(text: str) -> str:
    """``text`` without fenced code blocks and the contents of code spans (blanked, so lines
    keep their place; a span's first backtick stays, so that a role before it shows)."""
    return _CODE_SPAN.sub(lambda m: "`" + re.sub(r"[^\n]", " ", m.group(0)[1:]),
                          without_fences(text))


def plain_heading(text: str) -> str:
    """A heading's text as rendered: links reduced to their text, emphasis and code marks gone."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[*`]|(?<!\w)_|_(?!\w)", "", text)


def slug(title: str) -> str:
    """GitHub's heading anchor (MyST's ``github_slugify``): lower case, spaces to hyphens, every
    character that is not a letter, digit, ``_`` or ``-`` dropped."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def headings(page: Path) -> list[tuple[int, str, str]]:
    """``(level, text, anchor)`` of every heading of ``page``; a repeated slug gets ``-1``,
    ``-2``, ... as on GitHub and in MyST."""
    found: list[tuple[int, str, str]] = []
    seen: dict[str, int] = {}
    for line in without_fences(page.read_text(encoding="utf-8")).splitlines():
        match = _HEADING.match(line)
        if match:
            text = plain_heading(match.group(2))
            base = slug(text)
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.append((len(match.group(1)), text, base if count == 0 else f"{base}-{count}"))
    return found


def links(page: Path) -> list[tuple[int, str]]:
    """``(line, target)`` of every inline link, image and reference definition outside code."""
    text = prose(page.read_text(encoding="utf-8"))
    found = [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in _LINK.finditer(text)]
    found += [(text.count("\n", 0, m.start()) + 1, m.group(1))
              for m in _REFERENCE.finditer(text)]
    return found


def in_sphinx(page: Path) -> bool:
    return page.is_relative_to(DOCS)


def problems_of(page: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with ``page``'s links, one line each (paths shown relative to ``root``)."""
    problems = []
    name = page.relative_to(root)
    for line, target in links(page):
        where = f"{name}:{line}: {target!r}"
        scheme = _SCHEME.match(target)
        if scheme:
            if scheme.group(1).lower() not in _WEB_SCHEMES:
                problems.append(f"{where}: a `{scheme.group(1)}:` link works only in Sphinx; "
                                "GitHub shows a dead link. Use a relative path")
            continue
        path_text, _, anchor = target.partition("#")
        path_text = unquote(path_text)
        if path_text.startswith("/"):
            problems.append(f"{where}: an absolute path means the repository root on GitHub "
                            "and docs/ in Sphinx; use a relative path")
            continue
        dest = (page.parent / path_text).resolve() if path_text else page
        if not dest.exists():
            shown = dest.relative_to(root) if dest.is_relative_to(root) else dest
            problems.append(f"{where}: no such file {shown}")
            continue
        if dest.is_dir() and in_sphinx(page):
            problems.append(f"{where}: a link to a folder works on GitHub only; Sphinx cannot "
                            "follow it. Link a file in it")
            continue
        if anchor and dest.suffix == ".md":
            found = {a: level for level, _, a in headings(dest)}
            if anchor not in found:
                problems.append(f"{where}: no heading of {dest.relative_to(root)} has the "
                                f"anchor #{anchor}; its anchors: {sorted(found)}")
            elif in_sphinx(page) and in_sphinx(dest) and found[anchor] > SPHINX_ANCHOR_LEVELS:
                problems.append(f"{where}: #{anchor} is a level-{found[anchor]} heading; MyST "
                                f"makes anchors for levels 1-{SPHINX_ANCHOR_LEVELS} only")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    problems = problems_of(page)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_sphinx_role_shows_as_raw_text_on_github(page: Path) -> None:
    original = page.read_text(encoding="utf-8")
    text, lines = prose(original), original.splitlines()
    found = []
    for match in _ROLE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        found.append(f"{page.relative_to(ROOT)}:{line}: {lines[line - 1].strip()[:100]}")
    assert not found, ("MyST roles show as raw text on GitHub; link the API page instead, "
                       "[`name`](api/<package>.md):\n" + "\n".join(found))


def test_the_checker_sees_links_anchors_and_roles(tmp_path: Path) -> None:
    """The checker itself, on a page with one of each kind of problem, and code it must skip."""
    (tmp_path / "other.md").write_text(
        "# Other\n\n## A part: π, ω & `code`\n\n## A part: π, ω & `code`\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n"
        "[ok](other.md#a-part-π-ω--code) [dup](other.md#a-part-π-ω--code-1) [self](#page)\n"
        "[bad anchor](other.md#nope) [missing](nothing.md) ![img](pic.png)\n"
        "[dead](path:other.md) [web](https://flower.ai) {py:func}`x`\n\n"
        "```md\n[in code](nothing.md) {py:func}`y`\n```\n`[span](nothing.md)`\n")
    problems = problems_of(page, root=tmp_path)
    assert [p.split(": ", 1)[0] for p in problems] == ["page.md:4", "page.md:4", "page.md:4",
                                                       "page.md:5"], problems
    assert "#nope" in problems[0] and "nothing.md" in problems[1] and "pic.png" in problems[2]
    assert "`path:`" in problems[3]
    assert len(_ROLE.findall(prose(page.read_text()))) == 1


def test_anchors_are_the_ones_myst_makes() -> None:
    """The slug above is MyST's (``myst_heading_anchors``), heading by heading, so an anchor
    that resolves here resolves in the built site too."""
    slugs = pytest.importorskip("myst_parser.slugs", reason="myst-parser (the docs extra)")
    for page in PAGES:
        for _, text, _ in headings(page):
            assert slug(text) == slugs.github_slugify(text), (page, text)
