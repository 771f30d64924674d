"""What the docs say about the code is the code's: the names the paper-to-code table cites
exist, the package docstring and the docs page hold the same table, and every list of the
settings a resumed run may change is the checkpoint's own list."""

from __future__ import annotations

import importlib
import importlib.util
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


# ------------------------------------------------------------ figures tied to their records
ROOT = DOCS.parent
PERFORMANCE = ROOT / "results" / "performance"


def _record(name: str) -> dict[str, Any]:
    return json.loads((PERFORMANCE / f"{name}.json").read_text())


def _flat(path: Path) -> str:
    """A page's text with every run of whitespace (line breaks too) as one space."""
    return " ".join(path.read_text(encoding="utf-8").split())


def _min_s(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes} min {secs} s"


def _command(record: dict[str, Any]) -> str:
    """The command a record holds, without the ``--out`` that wrote it."""
    return re.sub(r" --out \S+", "", record["command"])


def _engine() -> list[str]:
    r = _record("engine")
    vs = r["engine_vs_bare"]
    return [_command(r), r["date"], r["torch"], "results/performance/engine.json",
            f"{vs['none']:.3f}× (FedAvg) and {vs['collective']:.3f}× (Collective",
            f"took {r['flower_vs_bare']['none']:.3f}× and {r['flower_vs_bare']['collective']:.3f}×",
            f"`max_rel_diff_float64` = {r['max_rel_diff_float64']}"]


#: The parts of the engine's round that docs/performance.md tabulates from the profile.
ENGINE_PARTS = ("round", "client/receive", "client/receive/settings", "client/receive/submodel",
                "client/train", "client/train/forward-loss", "client/train/backward",
                "client/train/optimizer-step", "client/train/optimizer-step/rules",
                "client/reply", "server/configure", "server/aggregate",
                "server/aggregate/reply-checks", "server/aggregate/receipts",
                "server/aggregate/robust", "server/aggregate/trust-record",
                "server/aggregate/combine", "server/end-round",
                "server/end-round/central-evaluation", "server/end-round/checkpoint",
                "array-codec", "other")


def _seconds(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def _engine_against() -> list[str]:
    r = _record("engine-against")
    vs, s, profile = r["engine_vs_bare"], r["s_per_round"], r["profile"]
    facts = [_command(r), r["date"], r["torch"], "results/performance/engine-against.json",
             f"load average {r['load-average'][0]:.1f}",
             f"with Collective {vs['work-tree']['collective']:.3f}× against "
             f"{vs['against']['collective']:.3f}×",
             f"sharding {vs['work-tree']['none']:.3f}× after against {vs['against']['none']:.3f}×",
             f"{r['repeats']} runs of {r['rounds']} rounds per side"]
    assert r["work_tree"]["uncommitted_changes"] == 0, "the record is of a committed tree"
    pfl = r["pfl"]
    assert pfl is not None, r.get("pfl_reason")
    facts += [f"pfl {pfl['version']}", f"| pfl-research's FedAvg | {pfl['pfl_vs_bare']:.3f} | "
              f"– | {pfl['s_per_round']['pfl']:.3f} s / {pfl['s_per_round']['bare']:.3f} s | – |"]
    sides = ("against", "work-tree")
    for side, label in (("against", "before (morning of 2026-11-30)"),
                        ("work-tree", "after (2026-11-30)")):
        facts.append(f"| {label} | {vs[side]['none']:.3f} | {vs[side]['collective']:.3f} | "
                     f"{s[side]['sequential']['none']:.3f} s / {s[side]['bare']['none']:.3f} s | "
                     f"{s[side]['sequential']['collective']:.3f} s / "
                     f"{s[side]['bare']['collective']:.3f} s |")
    for part in ENGINE_PARTS:
        cells = [_seconds(profile[side][m][part]) for m in ("none", "collective")
                 for side in ("against", "work-tree")]
        facts.append(f"| `{part}` | " + " | ".join(cells) + " |")
    runs = {side: [run["engine_vs_bare"] for run in r["runs"][side]] for side in sides}
    this, last = profile["work-tree"]["none"], profile["against"]["none"]
    now, before = runs["work-tree"], runs["against"]
    facts += [f"from {min(x['none'] for x in now):.3f}× to {max(x['none'] for x in now):.3f}×",
              f"from {min(x['collective'] for x in now):.3f}× to "
              f"{max(x['collective'] for x in now):.3f}× with Collective",
              f"is {this['client/train']:.3f} s of the {this['round']:.3f} s FedAvg round "
              f"after, against {last['client/train']:.3f} s of {last['round']:.3f} s before"]
    # "every run of the previous release took longer against its bare loop than every run of
    # this one", for both methods
    assert all(min(x[m] for x in before) > max(x[m] for x in now)
               for m in ("none", "collective"))
    for part, label in (("client/train/optimizer-step", "The optimizer step"),
                        ("client/receive", "Receiving"),
                        ("server/aggregate/trust-record", "the trust record"),
                        ("server/aggregate/robust", "the update spread")):
        facts.append(f"{label}** ({last[part]:.3f} s → {this[part]:.3f} s)"
                     if label[0].isupper() else
                     f"{label} ({last[part]:.3f} s → {this[part]:.3f} s)")
    checks = sum(this[k] for k in ("server/aggregate/reply-checks", "server/aggregate/robust",
                                   "server/aggregate/trust-record",
                                   "server/end-round/checkpoint"))
    bare = s["work-tree"]["bare"]["none"]
    facts += [f"together are {checks:.3f} s of the {this['round']:.3f} s round",
              f"That is {100 * checks / bare:.0f} % of a bare round ({bare:.3f} s)",
              f"come near {vs['work-tree']['none'] - checks / bare:.2f}×"]
    collective = profile["work-tree"]["collective"]
    facts += [f"the draws ({collective['server/configure']:.3f} s)",
              f"step hooks take {collective['client/train/optimizer-step/rules']:.3f} s"]
    loop = _record("train-loop")
    q, fq = loop["train_vs_bare_quartiles"], loop["train_vs_bare_fused_sgd_quartiles"]
    facts += [_command(loop), loop["date"], "results/performance/train-loop.json",
              f"{loop['pairs']} pairs run alternately: {loop['train_vs_bare']:.3f}× (quartiles "
              f"{q[0]:.3f} to {q[2]:.3f}; an epoch took {loop['s_per_epoch']['fedshard']:.4f} s "
              f"against {loop['s_per_epoch']['bare']:.4f} s)",
              f"{loop['train_vs_bare_fused_sgd']:.3f}× (quartiles {fq[0]:.3f} to {fq[2]:.3f}; "
              f"{loop['s_per_epoch']['bare_fused_sgd']:.4f} s an epoch)"]
    return facts


def _client_step() -> list[str]:
    r = _record("client-step")
    ms = r["step_time_ms"]["fedshard"]
    facts = [_command(r), r["date"], r["torch"], "results/performance/client-step.json",
             f"({ms['r0.1']:.0f} ms vs {ms['dense']:.0f} ms)",
             f"dense step ran at {r['gflops_per_s']['dense']} GFLOP/s",
             f"sub-model at {r['gflops_per_s']['r0.1']} GFLOP/s",
             f"{r['time_split_ms']['r0.1']['other']:.0f} ms of the r = 0.1 step against "
             f"{r['time_split_ms']['dense']['other']:.0f} ms of the dense one",
             f"met in this record ({r['step_time_ratio_r0.1']:.3f}×)",
             f"met ({r['bytes_ratio_r0.1']:.3f}×)",
             f"gives {r['plain_step_time_ratio_r0.1']:.3f}× at r = 0.1"]
    for key in sorted(k.removeprefix("step_time_ratio_r") for k in r
                      if k.startswith("step_time_ratio_r")):
        step = f"{r['step_time_ratio_r' + key]:.3f}"
        cells = [f"**{step}**" if key == "0.1" else step]
        cells += [f"{r[f'{name}_r{key}']:.3f}" for name in ("plain_step_time_ratio", "flop_ratio")]
        bytes_ = f"{r[f'bytes_ratio_r{key}']:.3f}"
        cells += [f"**{bytes_}**" if key == "0.1" else bytes_]
        cells += [f"{r[f'{name}_r{key}']:.3f}" for name in ("peak_memory_ratio",
                                                             "rss_peak_ratio")]
        if key == "0.1":
            cells[0] += f" ({ms['r0.1']:.0f} ms vs {ms['dense']:.0f} ms)"
        facts.append(f"| {key} | " + " | ".join(cells) + " |")
    return facts


def _receive() -> list[str]:
    r = _record("receive")
    return [_command(r), r["date"], r["torch"], "results/performance/receive.json",
            f"| {r['model_init_s']} s | {r['before_s']} s |",
            f"**{r['after_s']} s** ({r['speedup']}×)"]


def _batches() -> list[str]:
    r = _record("batches")
    c, e, t = r["client"], r["server_eval"], r["client_round"]
    return [_command(r), r["date"], r["torch"], "results/performance/batches.json",
            f"| {1e3 * c['data_loader_s']:.1f} ms | **{1e3 * c['tensor_batches_s']:.1f} ms** |",
            f"| {e['data_loader_s']} s | **{1e3 * e['tensor_batches_s']:.1f} ms** (built once "
            f"per run: {e['tensor_batches_build_once_s']} s) |",
            f"took {t['data_loader_s']} s through the DataLoader and {t['tensor_batches_s']} s "
            f"from `TensorBatches`",
            f"(`max_abs_param_diff` = {t['max_abs_param_diff']})"]


def _server() -> list[str]:
    r = _record("server-round")
    return [_command(r), r["date"], r["torch"], "results/performance/server-round.json",
            f"| {r['svd_s']:.2f} s | {r['sampling_s']:.3f} s | {r['pack_s']:.3f} s | "
            f"{r['aggregate_s']:.3f} s | **{r['overhead_ratio']:.2f}** (target ≤ 0.25) | "
            f"**{r['svd_vs_bare_ratio']:.2f}×** (target ≤ 1.5×) |",
            f"The bare loop took {r['bare_svd_s']:.2f} s"]


def _standardize() -> list[str]:
    r = _record("standardize")
    assert r["same_values"] and r["threads"] == 1
    return [_command(r), "results/performance/standardize.json",
            f"in {r['seconds']['batched']} s against {r['seconds']['one_by_one']} s image by image"]


def _scale() -> list[str]:
    r = _record("scale")
    big, small = r["nodes_1000_sampled_100"], r["nodes_100_sampled_10"]
    return [_command(r), r["date"], r["torch"], "results/performance/scale.json",
            f"{big['server_s_per_round']:.2f} s against {small['server_s_per_round']:.3f} s",
            f"**`server_time_ratio_1000_vs_100` = {r['server_time_ratio_1000_vs_100']:.1f}**",
            f"{big['first_round_server_s']:.2f} s against {small['first_round_server_s']:.2f} s",
            f"**`server_peak_mb` = {r['server_peak_mb']:.1f} MB**",
            f"({r['server_peak_mb_100']:.1f} MB at 100)"]


def _batched_kernels() -> list[str]:
    r = _record("batched-kernels")
    k, gn, ms = r["kernels_per_step"], r["group_norm_layer_kernels"], r["ms_per_step"]
    prof = {side: {row["op"]: row["ms"] for row in r["profile"][side]}
            for side in ("batched", "clients", "folded")}
    b, c, f = prof["batched"], prof["clients"], prof["folded"]
    assert r["shape"]["clients"] == 10 and r["profile"]["time"] == "cpu"
    assert "native_group_norm_backward" in r["only_per_client"]
    assert "aten::add" not in c  # "no addition was among the 12 slowest operations"
    assert r["convolutions_by_groups"]["folded"] == {"10": 39}
    assert k["folded"] < k["per_client"] and ms["folded"] < ms["batched"]  # "fewer", "faster"
    assert f["aten::native_group_norm_backward"] > 0  # "with GroupNorm's fused backward"
    return [_command(r), r["date"], r["torch"], "results/performance/batched-kernels.json",
            f"launched {k['batched']} for the 10 clients against {k['per_client']:.0f} for one "
            f"client's step ({k['clients']:,} for the ten): "
            f"{k['clients'] / k['batched']:.1f} times fewer",
            f"ran {r['only_per_client']['native_group_norm_backward']:.0f} times in a client's "
            f"step and never in the batched one",
            f"{gn['batched']} kernels for the clients together against {gn['one_client']} for "
            "one client alone",
            f"{r['only_batched']['clone']} copies (`clone`), "
            f"{r['more_than_one_client']['mul']['batched']} multiplications against "
            f"{r['more_than_one_client']['mul']['one_client']:.0f} in one client's step, "
            f"{r['more_than_one_client']['sum']['batched']} sums against "
            f"{r['more_than_one_client']['sum']['one_client']:.0f}",
            f"{r['convolutions_by_groups']['batched']['10']} a step against "
            f"{r['convolutions_by_groups']['clients']['1']}",
            f"vmap step took {ms['batched'] / 1e3:.1f} s against {ms['clients'] / 1e3:.1f} s",
            f"backward took {b['aten::convolution_backward'] / 1e3:.1f} s against "
            f"{c['aten::convolution_backward'] / 1e3:.1f} s",
            f"forward {b['aten::mkldnn_convolution'] / 1e3:.1f} s against "
            f"{c['aten::mkldnn_convolution'] / 1e3:.1f} s",
            f"took {b['aten::mul'] / 1e3:.1f}, {b['aten::copy_'] / 1e3:.1f} and "
            f"{b['aten::add'] / 1e3:.1f} s",
            f"the copies and multiplications took {c['aten::copy_'] / 1e3:.1f} and "
            f"{c['aten::mul'] / 1e3:.2f} s",
            f"launched {k['folded']} kernels for the 10 clients, fewer than one client's "
            f"{k['per_client']:.0f}",
            f"folded step took {ms['folded'] / 1e3:.1f} s, faster than vmap's "
            f"{ms['batched'] / 1e3:.1f} s",
            f"their backward took {f['aten::convolution_backward'] / 1e3:.1f} s against "
            f"{c['aten::convolution_backward'] / 1e3:.1f} s"]


def _finding() -> list[str]:
    step, scale = _record("client-step"), _record("scale")
    return [f"r = 0.1 step took {step['step_time_ratio_r0.1']:.3f}× the dense step's time for "
            f"{step['flop_ratio_r0.1']:.3f}× its FLOPs and {step['bytes_ratio_r0.1']:.3f}× its "
            "bytes",
            f"grew {scale['server_time_ratio_1000_vs_100']:.1f}× for 10× the sampled clients"]


def _first_runs() -> list[str]:
    first = json.loads(FIRST_RUN.read_text())
    defaults = json.loads((FIRST_RUN.parent / "flower-defaults.json").read_text())
    return [f"run took {_min_s(first['run-wall-s'])}",
            f"the run took {_min_s(defaults['run-wall-s'])}",
            f"reached {100 * defaults['final-test-accuracy']:.1f} %"]


@pytest.mark.parametrize("facts", [_finding, _engine, _engine_against, _batched_kernels,
                                   _client_step, _receive,
                                   _batches, _server, _standardize, _scale, _first_runs])
def test_each_figure_of_the_performance_page_is_its_records(facts: Any) -> None:
    """Every figure docs/performance.md prints, beside the command, date and torch version of
    the record it comes from, is that record's (results/performance/*.json)."""
    page = _flat(DOCS / "performance.md")
    missing = [fact for fact in facts() if " ".join(fact.split()) not in page]
    assert not missing, f"docs/performance.md lacks {missing}"


def test_the_simulation_pages_figures_are_their_records() -> None:
    engine, receive = _record("engine"), _record("receive")
    arrays = json.loads((PERFORMANCE / "wire-arrays.json").read_text())
    s, vs, run = engine["s_per_round"], engine["engine_vs_bare"], engine["engine_vs_bare_per_run"]
    rows = [f"| bare torch loop | {s['bare']['none']} | 1 | {s['bare']['collective']} | 1 |",
            f"| `sequential` engine | {s['sequential']['none']} | {vs['none']:.3f} | "
            f"{s['sequential']['collective']} | {vs['collective']:.3f} |",
            f"| `flwr run` (Ray, 2 ClientApps at once) | {s['flower']['none']} | "
            f"{engine['flower_vs_bare']['none']:.3f} | {s['flower']['collective']} | "
            f"{engine['flower_vs_bare']['collective']:.3f} |"]
    facts = [
        *rows, _command(engine), engine["date"], engine["torch"],
        f"{run['none']:.3f} for FedAvg and {run['collective']:.3f} for Collective, against "
        f"{vs['none']:.3f} and {vs['collective']:.3f} paired",
        f"`speedup_vs_flower`: {engine['speedup_vs_flower']['none']} for FedAvg, "
        f"{engine['speedup_vs_flower']['collective']} for Collective",
        f"(`max_rel_diff_float64` = {engine['max_rel_diff_float64']})",
        f"{receive['before_s']} → {receive['after_s']} s of host work per message",
        f"{arrays['encode_speedup']}× faster encoding and {arrays['decode_speedup']}× faster "
        "decoding",
        f"the run took {_min_s(json.loads(FIRST_RUN.read_text())['run-wall-s'])}"]
    page = _flat(DOCS / "simulation.md")
    missing = [fact for fact in facts if " ".join(fact.split()) not in page]
    assert not missing, f"docs/simulation.md lacks {missing}"


def test_the_sharding_pages_client_step_is_its_record() -> None:
    r = _record("client-step")
    page = _flat(DOCS / "sharding.md")
    fact = (f"r = 0.1 took {r['step_time_ratio_r0.1']:.3f}× the dense step's time with "
            f"{r['bytes_ratio_r0.1']:.3f}× the bytes on a CPU, and at r = 0.4 "
            f"{r['step_time_ratio_r0.4']:.3f}× with {r['bytes_ratio_r0.4']:.3f}×")
    assert fact in page


def test_readmes_run_times_are_the_records() -> None:
    first = json.loads(FIRST_RUN.read_text())
    defaults = json.loads((FIRST_RUN.parent / "flower-defaults.json").read_text())
    readme = " ".join(README.read_text().split())
    assert f"{_min_s(first['run-wall-s'])} (the install comes on top)" in readme
    assert (f"reached {100 * defaults['final-test-accuracy']:.1f} % in "
            f"{_min_s(defaults['run-wall-s'])}") in readme


def test_every_record_a_script_wrote_says_where_when_and_how() -> None:
    """The records written through benchmarks/machine.py's provenance(): machine (CPU model
    or GPU), torch version, date and the command, which the page quotes."""
    written = [path for path in sorted(PERFORMANCE.glob("*.json"))
               if "command" in json.loads(path.read_text())]
    assert len(written) >= 7, written
    for path in written:
        record = json.loads(path.read_text())
        assert record["machine"] and record["torch"] and re.fullmatch(
            r"\d{4}-\d\d-\d\d", record["date"]), path
        assert record["command"].startswith("python benchmarks/"), path
        cited = f"results/performance/{path.name}"
        assert any(cited in page.read_text(encoding="utf-8") for page in DOCS.glob("*.md")), \
            f"{cited} is cited by no page"
    loads = [json.loads(path.read_text())["load-average"][0] for path in written
             if "load-average" in json.loads(path.read_text())]
    assert (f"(load averages of {min(loads):.1f} to {max(loads):.1f} as the records that hold "
            "one ended)") in _flat(DOCS / "performance.md")


def test_no_figure_is_marked_as_lacking_its_record() -> None:
    pages = [README, *sorted(DOCS.rglob("*.md"))]
    marked = [str(p.relative_to(ROOT)) for p in pages
              if "_build" not in p.parts and "no committed record" in p.read_text().lower()]
    assert not marked, f"{marked} still quote figures marked as having no committed record"


# ------------------------------------------------------------ the privacy page's table
PRIVACY = ROOT / "results" / "privacy" / "dp_table.json"


def _dp_table(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # its sibling modules
    spec = importlib.util.spec_from_file_location("dp_table", ROOT / "benchmarks" / "dp_table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_privacy_pages_tables_and_figures_are_its_record(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/privacy.md's tables are what benchmarks/dp_table.py prints from the committed
    record, and the page names the record's size, seeds, machine, torch, date and command;
    the finding's figures are the record's means."""
    record = json.loads(PRIVACY.read_text())
    assert record["complete"] and record["seeds"] == [0, 1, 2]
    assert record["size"]["epsilons"] == [1.0, 4.0, 8.0] and record["size"]["delta"] == 1e-5
    page = _flat(DOCS / "privacy.md")
    tables = _dp_table(monkeypatch).markdown(record)
    assert " ".join(tables.split()) in page
    size = record["size"]
    means = record["summary"]

    def mean(row: str) -> str:
        return f"{100 * means[row]['accuracy-mean']:.1f} %"

    facts = [record["cpu"], record["torch"], record["date"], _command(record),
             "results/privacy/dp_table.json", "seeds 0, 1 and 2",
             f"{size['nodes']} nodes", f"{size['train-images']} training images",
             f"{size['rounds']} rounds", f"q = {size['sampling-rate']:g}",
             f"S = {size['clipping-norm']:g}", f"width {size['model'].split()[-1][:-1]}",
             *(mean(f"{m}/eps-8") for m in ("dense-fedavg", "heterofl", "collective")),
             *(mean(f"{m}/no-dp") for m in ("dense-fedavg", "heterofl", "collective")),
             mean(f"collective-min-holders-{size['min-holders'][0]}/eps-8")]
    missing = [fact for fact in facts if " ".join(fact.split()) not in page]
    assert not missing, f"docs/privacy.md lacks {missing}"
