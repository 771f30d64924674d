"""The library uses Flower through its public API, except where Flower has none; each such
use is listed here and pinned by a test that fails naming the installed Flower and what moved.

Public: ``flwr.app``, ``flwr.clientapp``, ``flwr.common`` (its ``__all__``), ``flwr.serverapp``
and ``flwr.serverapp.strategy``. The rest, by module, with the public API that would replace
it (:data:`PINNED`, :data:`ALTERNATIVES`):

- ``flwr.supercore.task_identity`` (``lab/fedshard_lab/engine/grid.py``): the in-process engine
  gives its process the task identity ``Message(...)`` reads, as Flower's runtimes do;
- ``Metadata``'s stored message id and sender (same file, ``_route``, the one place the
  library writes into a Flower object's ``__dict__``): set on the messages the engine routes,
  as Flower's in-memory grid does;
- ``flwr.common.constant.ErrorCode`` (same file): the code of a ClientApp that raised;
- ``flwr.common.logger`` (the library's logging): the module ``flwr.common.log`` comes from;
- ``flwr.common.config.parse_config_args`` (``lab/fedshard_lab/engine/__main__.py``): the engine's
  ``--run-config`` parsed as ``flwr run`` parses it.

Where the ServerApp runs (``fedshard/app/task.py``, ``grid_runtime``) is told by the class
names of the grids Flower's runtimes give it, duck-typed: no Flower module is imported for it;
the names are pinned below.
"""

from __future__ import annotations

import ast
import importlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import flwr
import pytest
from flwr.app import Message, MessageType, RecordDict
from flwr.serverapp import Grid

ROOT = Path(__file__).resolve().parents[1]
FLWR = f"flwr {flwr.__version__}"

PUBLIC = {"flwr", "flwr.app", "flwr.clientapp", "flwr.common", "flwr.serverapp",
          "flwr.serverapp.strategy"}
#: module -> the library files that may import it (None: any), each pinned below
PINNED: dict[str, set[str] | None] = {
    "flwr.supercore.task_identity": {"lab/fedshard_lab/engine/grid.py"},
    "flwr.common.constant": {"lab/fedshard_lab/engine/grid.py"},
    "flwr.common.logger": None,
    "flwr.common.config": {"lab/fedshard_lab/engine/__main__.py"},
}
#: each use of Flower beyond its public API -> the public API that would replace it
ALTERNATIVES: dict[str, str] = {
    "flwr.supercore.task_identity": (
        "none in flwr 1.42; a public way to build a Message outside a Flower runtime would "
        "replace it, and the app run by `flwr run` (or flwr.simulation.run_simulation) needs "
        "none"),
    "Metadata.__dict__": (
        "none in flwr 1.42 (Metadata has no setter for message_id or src_node_id); public "
        "setters would replace it, and under `flwr run` the SuperLink sets both"),
    "flwr.common.constant": (
        "none in flwr 1.42; the code exported by a public module (flwr.app) would replace it"),
    "flwr.common.logger": "flwr.common.log (public; the same function, pinned below)",
    "flwr.common.config": (
        "none in flwr 1.42; a public run-config parser would replace it, and `flwr run` "
        "parses --run-config itself"),
}


def _sources() -> list[Path]:
    """The library, the lab package (where the pinned internals live) and the two apps."""
    return [*sorted((ROOT / "fedshard").rglob("*.py")),
            *sorted((ROOT / "lab" / "fedshard_lab").rglob("*.py")),
            ROOT / "client_app.py", ROOT / "server_app.py"]


def _flower_imports() -> list[tuple[str, str]]:
    """``(file, module)`` for every Flower import in the library, the lab and the two apps."""
    found = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            found += [(path.relative_to(ROOT).as_posix(), n) for n in names
                      if n == "flwr" or n.startswith("flwr.")]
    return found


def test_the_library_uses_only_flowers_public_api_or_a_pinned_internal() -> None:
    used = _flower_imports()
    unpinned = [(f, m) for f, m in used if m not in PUBLIC and not (
        m in PINNED and (PINNED[m] is None or f in PINNED[m]))]
    assert not unpinned, (
        f"these files import Flower modules outside its public API ({sorted(PUBLIC)}): "
        f"{unpinned}. Use the public API, or isolate the use in one function and pin it in "
        "tests/test_flower_internals.py, with the public API that would replace it")
    stale = sorted(set(PINNED) - {m for _, m in used})
    assert not stale, f"pinned but no longer imported by the library: {stale}; unpin them"
    assert set(PINNED) <= set(ALTERNATIVES), "every pin names the public API that would replace it"


def test_the_library_writes_into_flower_objects_in_one_place() -> None:
    """Writes into an object's ``__dict__`` (how a Flower object's stored fields are set where
    it has no setter) happen in the engine's ``_route`` only."""
    found = []
    for path in _sources():
        tree = ast.parse(path.read_text())
        for func in ast.walk(tree):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                if (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store)
                        and isinstance(node.value, ast.Attribute)
                        and node.value.attr == "__dict__"):
                    found.append((path.relative_to(ROOT).as_posix(), func.name))
    assert sorted(set(found)) == [("lab/fedshard_lab/engine/grid.py", "_route")], (
        f"{FLWR}: the library writes into objects' __dict__ in {sorted(set(found))}; keep such "
        "writes in lab/fedshard_lab/engine/grid.py's _route, pinned here with the public API that "
        f"would replace them ({ALTERNATIVES['Metadata.__dict__']})")


# ---------------------------------------------------------------- the engine's task identity
def test_task_identity_is_where_the_engine_sets_it() -> None:
    try:
        from flwr.supercore.task_identity import TaskIdentity
    except ImportError as err:
        pytest.fail(f"{FLWR}: flwr.supercore.task_identity.TaskIdentity is gone ({err}); "
                    "fedshard's in-process engine (_ensure_task_identity in "
                    "lab/fedshard_lab/engine/grid.py) sets it for Message(...): find where this "
                    "Flower keeps the process's task identity. Public alternative: "
                    f"{ALTERNATIVES['flwr.supercore.task_identity']}")
    for name in ("run_id", "node_id", "task_id"):
        prop = type(TaskIdentity).__dict__.get(name)
        if not (isinstance(prop, property) and prop.fset is not None):
            pytest.fail(f"{FLWR}: flwr.supercore.task_identity.TaskIdentity has no settable "
                        f"{name} (found {prop!r}); the in-process engine "
                        "(lab/fedshard_lab/engine/grid.py, _ensure_task_identity) sets run_id, "
                        "node_id and task_id as flwr 1.42 has them. Public alternative: "
                        f"{ALTERNATIVES['flwr.supercore.task_identity']}")


_IDENTITY_SCRIPT = """
import json
from flwr.app import Message, MessageType, RecordDict

def ids():
    m = Message(RecordDict(), dst_node_id=5, message_type=MessageType.QUERY)
    return [m.metadata.run_id, m.metadata.src_node_id, m.metadata.src_task_id]

out = {}
try:
    ids()
    out["bare"] = None
except RuntimeError as err:
    out["bare"] = str(err)
from fedshard_lab.engine.grid import _ensure_task_identity
_ensure_task_identity()
out["engine"] = ids()
from flwr.supercore.task_identity import TaskIdentity
TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 7, 3, 9
_ensure_task_identity()
out["kept"] = ids()
print(json.dumps(out))
"""


def test_a_fresh_process_needs_the_engines_task_identity_to_build_a_message() -> None:
    """Why the engine sets it: in a process no Flower runtime started (the engine's), no
    instruction message can be built; with it, the messages carry the engine's run and node,
    and an identity already set is kept."""
    done = subprocess.run([sys.executable, "-c", _IDENTITY_SCRIPT], cwd=ROOT, text=True,
                          capture_output=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if out["bare"] is None:
        pytest.fail(f"{FLWR}: Message(...) now builds without a task identity; the engine's "
                    "_ensure_task_identity (lab/fedshard_lab/engine/grid.py) and its use of "
                    "flwr.supercore.task_identity can go")
    assert out["engine"] == [1, 0, 1]
    assert out["kept"] == [7, 3, 9]


def test_a_flower_without_task_identity_stops_the_engine_saying_so(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from fedshard_lab.engine import grid

    monkeypatch.setattr(grid, "_can_build_messages", lambda: False)
    monkeypatch.setitem(sys.modules, "flwr.supercore.task_identity", None)  # import fails
    with pytest.raises(RuntimeError, match=(
            rf"flwr {flwr.__version__}: the in-process engine must give this process a task "
            r"identity for Message\(\.\.\.\) to work, which flwr 1\.42 keeps in "
            r"flwr\.supercore\.task_identity\.TaskIdentity \(run_id, node_id, task_id\), but "
            r"here (ModuleNotFound|Import)Error: .*The engine cannot run with this Flower; run "
            r"the app with `flwr run`, or install flwr 1\.42")):
        grid._ensure_task_identity()


def test_a_flower_that_reads_its_identity_elsewhere_stops_the_engine_saying_so(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from fedshard_lab.engine import grid

    monkeypatch.setattr(grid, "_can_build_messages", lambda: False)
    with pytest.raises(RuntimeError, match=(
            rf"flwr {flwr.__version__}: the in-process engine set "
            r"flwr\.supercore\.task_identity\.TaskIdentity \(\{'run_id': 1, 'node_id': 0, "
            r"'task_id': 1\}\), as flwr 1\.42's Message\(\.\.\.\) reads it, but a message still "
            r"cannot be built: this Flower reads its identity elsewhere")):
        grid._ensure_task_identity()


# ------------------------------------------------------------ routed messages, error code
def test_a_routed_messages_id_and_sender_are_where_the_engine_sets_them() -> None:
    from fedshard_lab.engine.grid import _ensure_task_identity, _route

    _ensure_task_identity()
    msg = Message(RecordDict(), dst_node_id=1005, message_type=MessageType.TRAIN)
    try:
        _route(msg, src_node_id=0, message_id="m-1")
        reply = Message(RecordDict(), reply_to=msg)
        _route(reply, src_node_id=1005)
    except RuntimeError as err:
        pytest.fail(f"{err} Public alternative: {ALTERNATIVES['Metadata.__dict__']}")
    assert (msg.metadata.message_id, msg.metadata.src_node_id) == ("m-1", 0)
    assert reply.metadata.reply_to_message_id == "m-1"  # what the reply refers to
    assert (reply.metadata.src_node_id, reply.metadata.dst_node_id) == (1005, 0)


def test_a_flower_that_stores_them_elsewhere_stops_the_engine_saying_so() -> None:
    from fedshard_lab.engine.grid import _route

    class Frozen:  # a Metadata whose public properties ignore the stored fields
        message_id, src_node_id = "", 1

    class Fake:
        metadata = Frozen()

    with pytest.raises(RuntimeError, match=(
            rf"flwr {flwr.__version__}: the in-process engine sets a routed message's id and "
            r"sender where flwr 1\.42 keeps them \(Metadata's _message_id and _src_node_id\), "
            r"but this Flower's message still reads message_id='', src_node_id=1 \(expected "
            r"'m-1', 0\)\. The engine cannot run with this Flower")):
        _route(Fake(), src_node_id=0, message_id="m-1")  # type: ignore[arg-type]


def test_the_error_code_of_a_clientapp_that_raised() -> None:
    try:
        from flwr.common.constant import ErrorCode

        code = ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    except (ImportError, AttributeError) as err:
        pytest.fail(f"{FLWR}: flwr.common.constant.ErrorCode.CLIENT_APP_RAISED_EXCEPTION is "
                    f"gone ({err}); the in-process engine (lab/fedshard_lab/engine/grid.py) gives "
                    "it to the error reply of a node whose handler raised. Public alternative: "
                    f"{ALTERNATIVES['flwr.common.constant']}")
    assert isinstance(code, int)


# ------------------------------------------------------------------ the runtimes' grids
def test_flowers_runtimes_give_the_serverapp_the_grids_grid_runtime_knows() -> None:
    """``grid_runtime`` knows the runtimes by their grids' class names (no Flower module
    imported): the names are those of the grids flwr's runtimes build, and each is told."""
    from fedshard.app.task import RUNTIME_GRIDS, grid_runtime

    try:
        from flwr.superlink.grid import HttpGrid, InMemoryGrid
    except ImportError as err:
        pytest.fail(f"{FLWR}: flwr.superlink.grid has no HttpGrid and InMemoryGrid ({err}); "
                    "fedshard.app.task.grid_runtime tells a ServerApp's runtime by these "
                    f"names ({sorted(RUNTIME_GRIDS)}) and now logs that it cannot")
    assert issubclass(HttpGrid, Grid) and issubclass(InMemoryGrid, Grid)
    # the runtimes build them: the SuperLink's ServerApp runner and the simulation (modules
    # named as functions their packages export, hence import_module)
    run_serverapp = importlib.import_module("flwr.superlink.runtime.run_serverapp")
    run_simulation = importlib.import_module("flwr.simulation.run_simulation")
    if getattr(run_serverapp, "HttpGrid", None) is not HttpGrid:
        pytest.fail(f"{FLWR}: the SuperLink's ServerApp runner "
                    "(flwr.superlink.runtime.run_serverapp) no longer uses "
                    "flwr.superlink.grid.HttpGrid; grid_runtime (fedshard/app/task.py) would "
                    "not know a deployed ServerApp")
    if getattr(run_simulation, "InMemoryGrid", None) is not InMemoryGrid:
        pytest.fail(f"{FLWR}: Flower's simulation (flwr.simulation.run_simulation) no longer "
                    "uses flwr.superlink.grid.InMemoryGrid; grid_runtime (fedshard/app/task.py) "
                    "would not know a simulated ServerApp")
    # instances without their runtime's state: only the class matters
    assert grid_runtime(object.__new__(InMemoryGrid)) == "simulation"
    assert grid_runtime(object.__new__(HttpGrid)) == "deployment"
    assert grid_runtime(object()) is None


def test_a_flower_grid_it_does_not_know_is_logged_once_and_the_run_goes_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from flwr.common.logger import FLOWER_LOGGER

    from fedshard.app import task

    class RenamedGrid:  # a grid of a Flower that names its runtimes' grids otherwise
        __module__ = "flwr.superlink.grid.renamed"

    class TestGrid:  # a test's own grid: not Flower's, nothing to say
        pass

    monkeypatch.setattr(task, "_RUNTIME_UNKNOWN", [])
    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    FLOWER_LOGGER.addHandler(handler)
    try:
        assert task.grid_runtime(RenamedGrid()) is None
        assert task.grid_runtime(RenamedGrid()) is None
        assert task.grid_runtime(TestGrid()) is None
    finally:
        FLOWER_LOGGER.removeHandler(handler)
    assert len(lines) == 1, lines
    assert lines[0].startswith(
        f"fedshard cannot tell whether this ServerApp runs in Flower's simulation or on a "
        f"SuperLink: flwr {flwr.__version__} gives it a flwr.superlink.grid.renamed.RenamedGrid, "
        "which is neither of the grids of flwr 1.42's two runtimes (InMemoryGrid, HttpGrid)")
    assert lines[0].endswith("a deployed SuperNode that took a simulated node's settings "
                             "(only partition-id and num-partitions in its node config) is "
                             "not warned.")


# ------------------------------------------------------------------ logging, config parsing
def test_the_library_logs_with_flowers_public_log() -> None:
    import flwr.common
    import flwr.common.logger

    if flwr.common.logger.log is not flwr.common.log:
        pytest.fail(f"{FLWR}: flwr.common.logger.log is no longer flwr.common.log; the "
                    "library logs with flwr.common.logger.log")


def test_the_engine_parses_run_config_as_flower_does() -> None:
    try:
        from flwr.common.config import parse_config_args
    except ImportError as err:
        pytest.fail(f"{FLWR}: flwr.common.config.parse_config_args is gone ({err}); the "
                    "engine's --run-config (lab/fedshard_lab/engine/__main__.py) uses it")
    assert parse_config_args(["lr=0.1 run-name='x'"]) == {"lr": 0.1, "run-name": "x"}
