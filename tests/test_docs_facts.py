"""What the docs say about the code is the code's: the names the paper-to-code table cites
exist, the package docstring and the docs page hold the same table, and every list of the
settings a resumed run may change is the checkpoint's own list."""

from __future__ import annotations

import importlib
import json
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


def test_every_results_json_the_docs_cite_is_committed() -> None:
    root = DOCS.parent
    # a repository path (`results/...`, `../results/...`), not a deployment's `$D/results/...`
    found = (re.findall(r"(?<![\w$/.])(?:\.\./)?(results/[\w./-]+\.json)",
                        page.read_text(encoding="utf-8")) for page in DOCS.glob("*.md"))
    cited = {path for paths in found for path in paths}
    assert "results/performance/sampling.json" in cited  # the search finds citations
    missing = sorted(c for c in cited if not (root / c).is_file())
    assert not missing, f"the docs cite {missing}, which are not committed"


def test_the_performance_pages_recorded_figures_are_their_jsons() -> None:
    """The sampling-core table and the Flower-arrays figures say what their JSON says, and
    the page's machine line names the JSON's CPU and torch."""
    root = DOCS.parent
    page = (DOCS / "performance.md").read_text(encoding="utf-8")
    sampling = json.loads((root / "results/performance/sampling.json").read_text())
    arrays = json.loads((root / "results/performance/wire-arrays.json").read_text())
    expected = [
        f"{sampling['date']}, 2 cores of an {sampling['cpu']}",
        f"**{sampling['collective_speedup_vs_algorithm2']:.0f}×**",
        f"**{sampling['unbiased_speedup_vs_algorithm1']:.1f}×**",
        f"**{sampling['cps_speedup_vs_r_upmaxentropy']:.0f}×**",
        f"{arrays['date']}, 2 cores of an {arrays['device']}",
        f"{arrays['ms_per_state_dict']['fedshard_encode']:.2f} ms to encode",
        f"{arrays['ms_per_state_dict']['flower_decode']:.2f} ms with Flower's",
    ]
    missing = [text for text in expected if text not in page]
    assert not missing, f"docs/performance.md lacks {missing}"
    machine = next(line for line in page.splitlines() if line.startswith("| development machine"))
    assert f"({sampling['cpu']})" in machine and arrays["torch"] in machine, machine


README = DOCS.parent / "README.md"
FIRST_RUN = DOCS.parent / "results" / "first-run" / "first-run.json"


def test_readmes_first_run_is_the_committed_record() -> None:
    # the expected output README quotes is what benchmarks/first_run.py recorded, with the
    # machine, torch version and date it came from
    record = json.loads(FIRST_RUN.read_text())
    readme = README.read_text()
    section = readme.split("## The first run", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```\n(.*?)```", section, flags=re.S)
    assert blocks[0].strip().splitlines() == record["round-lines"]
    assert blocks[1].strip().splitlines() == record["sharding-bought"]
    assert record["returncode"] == 0 and record["status"] == "finished"
    for fact in (record["machine"], record["torch"], record["date"],
                 f"{100 * record['final-test-accuracy']:.1f} %",
                 "results/first-run/first-run.json"):
        assert fact in " ".join(section.split()), fact
    assert record["honest-nodes-named-at-warning"] == 0
    fedshard_warnings = [w for w in record["warnings"] if not w.startswith(_FLOWERS_WARNINGS)]
    assert fedshard_warnings == []


#: The WARNING lines of a run that Flower itself logs, whatever the app does.
_FLOWERS_WARNINGS = ("Since flwr 1.32", "fraction_evaluate is set to 0.0")
