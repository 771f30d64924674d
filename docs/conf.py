"""Sphinx configuration of fedshard's documentation (MyST Markdown pages, numpydoc docstrings).

Build with warnings as errors, as the test does::

    python -m sphinx -W --keep-going -b html docs docs/_build/html
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # import fedshard from the checkout, installed or not
sys.path.insert(1, str(ROOT / "lab"))  # and the lab tooling (fedshard_lab), likewise
os.environ.setdefault("OMP_NUM_THREADS", "1")  # importing torch must not take every core

project = "fedshard"
author = "The fedshard developers"
copyright = "The fedshard developers, Apache-2.0"
release = "0.1.0"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build"]

# MyST: $…$ math, ::: fences, heading anchors for [text](page.md#anchor) links.
myst_enable_extensions = ["colon_fence", "dollarmath", "deflist"]
myst_heading_anchors = 3

# API reference: each package page documents its __all__; autosummary only renders tables
# (no stub generation), so each object is documented once, at its package.
autosummary_generate = False
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"show-inheritance": True}
# A light build: the API pages import fedshard, which imports torch, torchvision and Flower.
# Where one is not installed, autodoc mocks it, so the site builds with Sphinx, MyST, furo and
# numpy alone (contributing.md); classes built on a mocked base (the strategies) then show a
# generic signature. With the whole stack installed nothing is mocked.
autodoc_mock_imports = [name for name in ("torch", "torchvision", "flwr", "matplotlib")
                        if importlib.util.find_spec(name) is None]

# Docstrings are numpydoc; napoleon reads them.
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_rtype = False
napoleon_use_ivar = True

# No intersphinx (the build runs offline): references to torch, numpy and Flower types stay
# plain text. nitpicky is off; these patterns keep those external names quiet where a builder
# turns it on (`-n`), so that only fedshard's own broken references show.
nitpicky = False
nitpick_ignore_regex = [
    ("py:.*", r"(torch|numpy|np|flwr|ray|matplotlib|collections\.abc|typing|pathlib)(\..*)?"),
    ("py:.*", r"(Module|Tensor|Generator|ndarray|ArrayLike|Message|Context|Grid|ArrayRecord|"
              r"ConfigRecord|MetricRecord|RecordDict|Strategy|FedAvg|Result|Path|Callable|"
              r"Iterable|Iterator|Mapping|Sequence|Any|Optimizer|Dataset|DataLoader)"),
]

html_theme = "furo"
html_title = "fedshard"


# A package re-exports constants defined in its modules, where their `#:` comments live;
# autodoc looks for those comments only in the package's own source. The API pages list them
# with explicit `autodata` directives, and this hook fills in the comment from the module.
def _submodule_attr_docs(package: str) -> dict[str, list[str]]:
    import importlib
    import pkgutil

    from sphinx.pycode import ModuleAnalyzer

    docs: dict[str, list[str]] = {}
    module = importlib.import_module(package)
    for info in pkgutil.iter_modules(getattr(module, "__path__", [])):
        try:
            analyzer = ModuleAnalyzer.for_module(f"{package}.{info.name}")
            found = analyzer.find_attr_docs()
        except Exception:  # a module the analyzer cannot read documents nothing here
            continue
        for (scope, name), lines in found.items():
            if scope == "":
                docs.setdefault(name, list(lines))
    return docs


_ATTR_DOCS: dict[str, dict[str, list[str]]] = {}


def _reexported_constant_doc(package: str, name: str) -> list[str] | None:
    if package not in _ATTR_DOCS:
        _ATTR_DOCS[package] = _submodule_attr_docs(package)
    return _ATTR_DOCS[package].get(name)


def _fill_constant_doc(app, what, name, obj, options, lines):
    # a re-exported tuple would otherwise show tuple's own docstring
    if what == "data":
        package, _, short = name.rpartition(".")
        doc = _reexported_constant_doc(package, short)
        if doc:
            lines[:] = list(doc)


# A page links a committed file outside docs/ with a plain relative link, which GitHub follows
# (`[table](../results/beyond/table.md)`). MyST takes a `.md` target for a page of this site and
# fails to find it; this transform turns such a link into a download of the file instead. Links
# to other files (`.json`, `.png`) are downloads already.
def _repo_file_links():
    from sphinx import addnodes
    from sphinx.transforms import SphinxTransform

    class RepoFileLinks(SphinxTransform):
        default_priority = 5  # before Sphinx collects the page's downloads

        def apply(self, **kwargs):
            env = self.env
            srcdir = Path(env.srcdir)
            page_dir = Path(env.doc2path(env.docname)).parent
            for node in list(self.document.findall(addnodes.pending_xref)):
                target = node.get("reftarget", "")
                if node.get("refdomain") != "doc" or target in env.found_docs:
                    continue
                base = Path(target) if Path(target).is_absolute() else srcdir / target
                for suffix in env.config.source_suffix:
                    path = base.with_name(base.name + suffix)
                    if path.is_file() and not path.resolve().is_relative_to(srcdir.resolve()):
                        link = addnodes.download_reference(
                            refdomain=None, reftype="myst", refdoc=env.docname,
                            refexplicit=True, reftarget=os.path.relpath(path, page_dir),
                            classes=["xref", "download", "myst"])
                        link += node.children
                        node.replace_self(link)
                        break

    return RepoFileLinks


def setup(app):
    app.connect("autodoc-process-docstring", _fill_constant_doc)
    app.add_transform(_repo_file_links())
