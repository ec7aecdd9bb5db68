"""The house rules of docs/layout.md, checked on the code itself: the conversion's rooms import only
downwards, nothing imports in a circle, every module is where the layout page says, and no
function is longer than 75 lines."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from conftest import REPO

PACKAGE = REPO / "uptrain"
ROOMS = ["registry", "io", "math", "layers"]  # from the ground up: each imports only the ones before it
MAY_IMPORT = {"registry": set(), "io": {"registry"}, "math": {"registry"}, "layers": {"registry", "io", "math"}}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports(path: Path) -> set[str]:
    """The uptrain modules `path` imports anywhere in it (lazy imports inside functions too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("uptrain"):
            subs = [f"{node.module}.{a.name}" for a in node.names]
            found.update(s for s in subs if s in MODULES)
            if not all(s in MODULES for s in subs):  # names from a module, not submodules of a package
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("uptrain"))
    return {m for m in found if m in MODULES and MODULES[m] != path}


GRAPH = {name: imports(path) for name, path in MODULES.items()}


def room(name: str) -> str | None:
    """The conversion room of a module ('io'), '' for the conversion's top, None outside it."""
    parts = name.split(".")
    if parts[:2] != ["uptrain", "convert"]:
        return None
    return parts[2] if len(parts) > 3 and parts[2] in ROOMS else ""


def test_the_conversion_rooms_import_only_downwards():
    wrong = []
    for name, deps in GRAPH.items():
        mine = room(name)
        if mine is None:
            continue
        for dep in deps:
            theirs = room(dep)
            if theirs is None:
                if dep.startswith(("uptrain.train", "uptrain.measure", "uptrain.sweep", "uptrain.demo")):
                    wrong.append(f"{name} -> {dep} (convert uses neither train nor measure)")
            elif mine != "" and theirs != mine and (theirs == "" or theirs not in MAY_IMPORT[mine]):
                wrong.append(f"{name} -> {dep}")
    assert not wrong, wrong


def circles(graph: dict[str, set[str]]) -> list[str]:
    """Every import circle found by a depth-first walk of `graph` (module -> modules it imports)."""
    found, state = [], {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for dep in sorted(graph[name]):
            if state.get(dep) == "open":
                found.append(" -> ".join(path[path.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, path + [dep])
        state[name] = "done"
    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    return found


def test_no_module_imports_in_a_circle():
    assert not circles(GRAPH), circles(GRAPH)
    # and the walk sees one: the refinement's math importing the layer that uses it
    broken = {**GRAPH, "uptrain.convert.math.refine": GRAPH["uptrain.convert.math.refine"]
              | {"uptrain.convert.layers.refine_layer"}}
    assert any("uptrain.convert.math.refine -> uptrain.convert.layers.refine_layer" in c for c in circles(broken))


def test_the_layout_page_names_every_conversion_module_in_its_room():
    page = (REPO / "docs" / "layout.md").read_text()
    table = page[page.index("### Inside `uptrain/convert/`"):]
    for r in ROOMS:
        row = next(line for line in table.splitlines() if line.startswith(f"| `{r}/` |"))
        named = set(re.findall(r"`(\w+)\.py`", row))
        present = {p.stem for p in (PACKAGE / "convert" / r).glob("*.py") if p.stem != "__init__"}
        assert named == present, (r, sorted(named ^ present))
    top = next(line for line in table.splitlines() if line.startswith("| top |"))
    present = {p.stem for p in (PACKAGE / "convert").glob("*.py") if p.stem != "__init__"}
    assert set(re.findall(r"`(\w+)\.py`", top)) == present


def test_a_broken_rule_is_seen(tmp_path):
    """The room check itself goes red: math importing the layer stream is an arrow up."""
    global GRAPH
    saved = GRAPH
    GRAPH = {**GRAPH, "uptrain.convert.math.fit": GRAPH["uptrain.convert.math.fit"]
             | {"uptrain.convert.layers.layer_stream"}}
    try:
        with pytest.raises(AssertionError, match="math.fit -> uptrain.convert.layers.layer_stream"):
            test_the_conversion_rooms_import_only_downwards()
    finally:
        GRAPH = saved


def test_no_function_is_longer_than_75_lines():
    long = [f"{module_name(p)}.{n.name}: {n.end_lineno - n.lineno + 1} lines"
            for p in PACKAGE.rglob("*.py") for n in ast.walk(ast.parse(p.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 75]
    assert not long, long


# The trainer's run plan (uptrain/train/plan/): made before anything is built, so it reads the
# config, the launch and the run folder, never a module that builds or runs the training.
TRAIN_BUILDS = {"uptrain.train.loop", "uptrain.train.steps", "uptrain.train.setup", "uptrain.train.report.report",
                "uptrain.train.state.run_state", "uptrain.train.parallel.shard",
                "uptrain.train.model.teacher_samples", "uptrain.train.model.validate", "uptrain.train.__main__"}


def test_the_run_plan_imports_nothing_that_builds_or_runs():
    wrong = [f"{name} -> {dep}" for name, deps in GRAPH.items() if name.startswith("uptrain.train.plan")
             for dep in deps if dep in TRAIN_BUILDS]
    assert not wrong, wrong
    page = (REPO / "docs" / "layout.md").read_text()
    row = next(line for line in page.splitlines() if line.startswith("| `uptrain/train/` |"))
    present = {p.stem for p in (PACKAGE / "train" / "plan").glob("*.py") if p.stem != "__init__"}
    assert present <= set(re.findall(r"`(\w+)\.py`", row)), sorted(present - set(re.findall(r"`(\w+)\.py`", row)))


# The trainer's rooms (uptrain/train/<room>/), from the ground up: each imports only the rooms
# listed for it and `uptrain.train.config` (the run's options, read by every room); none imports
# the top's loop, steps, set-up or CLI. The top holds the entry points and the loop, at most 8 modules.
TRAIN_ROOMS = ["stop", "state", "plan", "model", "parallel", "report"]
TRAIN_MAY_IMPORT = {"stop": set(), "state": {"stop"}, "plan": {"stop", "state"}, "model": set(),
                    "parallel": set(), "report": {"parallel"}}
TRAIN_GROUND = {"uptrain.train.config"}


def train_room(name: str) -> str | None:
    """The trainer's room of a module ('state'), '' for the trainer's top, None outside the trainer."""
    parts = name.split(".")
    if parts[:2] != ["uptrain", "train"]:
        return None
    return parts[2] if len(parts) > 3 and parts[2] in TRAIN_ROOMS else ""


def test_the_trainer_rooms_import_only_downwards():
    wrong = []
    for name, deps in GRAPH.items():
        mine = train_room(name)
        if not mine:
            continue
        for dep in deps:
            theirs = train_room(dep)
            if theirs is None or theirs == mine or dep in TRAIN_GROUND:
                continue
            if theirs == "" or theirs not in TRAIN_MAY_IMPORT[mine]:
                wrong.append(f"{name} -> {dep}")
    assert not wrong, wrong


def test_a_broken_trainer_rule_is_seen():
    """The trainer's room check goes red too: the run's state importing the plan is an arrow up."""
    global GRAPH
    saved = GRAPH
    GRAPH = {**GRAPH, "uptrain.train.state.run_state": GRAPH["uptrain.train.state.run_state"]
             | {"uptrain.train.plan.folders"}}
    try:
        with pytest.raises(AssertionError, match="state.run_state -> uptrain.train.plan.folders"):
            test_the_trainer_rooms_import_only_downwards()
    finally:
        GRAPH = saved


def test_the_trainer_top_is_small_and_the_layout_page_names_every_trainer_module():
    top = {p.stem for p in (PACKAGE / "train").glob("*.py")}
    assert len(top) <= 8, sorted(top)
    rooms = {p.name for p in (PACKAGE / "train").iterdir() if (p / "__init__.py").is_file()}
    assert rooms == set(TRAIN_ROOMS), sorted(rooms ^ set(TRAIN_ROOMS))
    page = (REPO / "docs" / "layout.md").read_text()
    row = next(line for line in page.splitlines() if line.startswith("| `uptrain/train/` |"))
    present = {p.stem for p in (PACKAGE / "train").rglob("*.py") if p.stem != "__init__"}
    assert present <= set(re.findall(r"`(\w+)\.py`", row)), sorted(present - set(re.findall(r"`(\w+)\.py`", row)))


# The package's top and scripts/ (docs/layout.md): entry points and a few shared utilities at the
# top, every job with rooms of its own in a folder; stop signals handled in one room.
TOP_LIMIT, SCRIPTS_LIMIT = 10, 12
STOP_ROOMS = ("uptrain.stopping.", "uptrain.train.stop.")  # the behaviours, and the trainer's use of one


def top_modules() -> list[str]:
    return sorted(p.stem for p in PACKAGE.glob("*.py"))


def sets_a_handler(tree: ast.AST) -> bool:
    """Whether the code calls `signal.signal(...)` anywhere."""
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "signal"
               and isinstance(n.func.value, ast.Name) and n.func.value.id == "signal" for n in ast.walk(tree))


def signal_installers() -> list[str]:
    """The package's modules that set a signal handler."""
    return sorted(name for name, path in MODULES.items() if sets_a_handler(ast.parse(path.read_text())))


def test_the_top_holds_entry_points_and_a_few_utilities():
    top = top_modules()
    assert len(top) <= TOP_LIMIT, top
    assert not [m for m in top if m.startswith("sweep")], top  # the sweep is a room: uptrain/sweep/
    scripts = sorted(p.name for p in (REPO / "scripts").iterdir() if p.name != "__pycache__")
    assert len(scripts) <= SCRIPTS_LIMIT, scripts


def test_stop_signals_are_handled_in_the_stop_rooms_only():
    installers = signal_installers()
    assert installers and all(m.startswith(STOP_ROOMS) for m in installers), installers
    # and the check sees a handler set anywhere, not a handler read
    assert sets_a_handler(ast.parse("def f():\n    import signal\n    signal.signal(2, print)"))
    assert not sets_a_handler(ast.parse("import signal\nsignal.getsignal(2)"))


def test_the_layout_page_names_every_module_of_the_sweep_and_stop_rooms():
    page = (REPO / "docs" / "layout.md").read_text()
    for folder in ("sweep", "stopping"):
        row = next(line for line in page.splitlines() if line.startswith(f"| `uptrain/{folder}/` |"))
        present = {p.stem for p in (PACKAGE / folder).glob("*.py")} - {"__main__", "__init__"}
        named = set(re.findall(r"`(\w+)\.py`", row))
        assert present <= named, (folder, sorted(present - named))
