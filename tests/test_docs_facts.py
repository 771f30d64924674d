"""What the docs say about the code is the code's: the names the paper-to-code table cites
exist, the package docstring and the docs page hold the same table, and every list of the
settings a resumed run may change is the checkpoint's own list."""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

import pytest

import fedshard
from fedshard.app.checkpoint import RESUME_MAY_CHANGE
from fedshard.app.config import RunConfig

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _resolve(dotted: str) -> Any:
    """The object a dotted name names, as ``from a.b import c`` finds it: the longest prefix
    that imports as a module, then attributes (a package's re-exported function may shadow the
    module of the same name, ``fedshard.spectral.decompose``)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)  # AttributeError: the name does not exist
        return obj
    raise ImportError(dotted)


def _docstring_table_names() -> list[str]:
    table = fedshard.__doc__.split("From the paper to the code", 1)[1]
    return re.findall(r"``(fedshard(?:\.\w+)*)``", table)


def _paper_page_table_names() -> list[str]:
    page = (DOCS / "paper.md").read_text(encoding="utf-8")
    rows = "\n".join(line for line in page.splitlines() if line.startswith("|"))
    return re.findall(r"`(fedshard(?:\.\w+)*)`", rows)


@pytest.mark.parametrize("name", sorted(set(_docstring_table_names())
                                        | set(_paper_page_table_names())))
def test_every_name_the_paper_to_code_table_cites_exists(name: str) -> None:
    try:
        _resolve(name)
    except (ImportError, AttributeError) as err:
        pytest.fail(f"{name}, cited by the paper-to-code table, does not exist ({err!r})")


def test_the_resolver_refuses_a_name_that_does_not_exist() -> None:
    with pytest.raises(AttributeError):
        _resolve("fedshard.client.train.optim.ClipLR.column_scale")
    with pytest.raises(AttributeError):
        _resolve("fedshard.FrobeniusDecay")
    assert _resolve("fedshard.spectral.decompose.layer_spectrum").__name__ == "layer_spectrum"


def test_the_package_docstring_and_the_paper_page_hold_the_same_table() -> None:
    """docs/paper.md says its table is the package docstring's: the same names, row by row."""
    in_docstring = _docstring_table_names()
    assert len(in_docstring) >= 16, in_docstring  # the table was found
    assert in_docstring == _paper_page_table_names()


#: The pages that list the settings a resumed run may change, each once, written
#: "... a resumed run may change (`key`, `key`, ...)".
RESUME_PAGES = ("configuration.md", "reproducing.md", "deployment.md")


@pytest.mark.parametrize("page", RESUME_PAGES)
def test_each_pages_list_of_what_a_resumed_run_may_change_is_the_checkpoints(page: str) -> None:
    text = (DOCS / page).read_text(encoding="utf-8")
    lists = re.findall(r"a resumed run may change\s*\(([^)]*)\)", text)
    assert len(lists) == 1, f"docs/{page}: expected one list of what a resumed run may change"
    listed = re.findall(r"`([^`]+)`", lists[0])
    # `resume` and `overwrite` are how a relaunch is asked for, not settings of the run
    expected = [key for key in RESUME_MAY_CHANGE if key not in ("resume", "overwrite")]
    assert listed == expected, f"docs/{page} lists {listed}; the checkpoint allows {expected}"


def test_every_key_a_resumed_run_may_change_is_a_run_config_key() -> None:
    known = set(RunConfig().as_dict())
    assert "lr" in known and "results-dir" in known  # the run config's keys, kebab-case
    unknown = sorted(set(RESUME_MAY_CHANGE) - known)
    assert not unknown, f"RESUME_MAY_CHANGE names {unknown}, which are not run-config keys"
