"""The import graph of ``mia/``: no circle, and a function-level import of mia's own modules only with a reason.

Every ``import`` / ``from ... import`` statement of every module counts, at the top or inside a function, so a
circle hidden behind a local import is still a circle. A local import of one of mia's modules is allowed only
with a comment on its line saying why (the CLI's fast start, a registry that imports its members).
"""
import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mia"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def resolve(node, current: str, is_package: bool, modules: dict) -> list[str]:
    """The mia modules one import statement names (a ``from pkg import sub`` names the submodule)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "mia"]
    base = current if is_package else current.rpartition(".")[0]
    for _ in range(max(0, node.level - 1)):
        base = base.rpartition(".")[0]
    target = (f"{base}.{node.module}" if node.module else base) if node.level else (node.module or "")
    if target.split(".")[0] != "mia":
        return []
    out = []
    for a in node.names:
        sub = f"{target}.{a.name}"
        out.append(sub if sub in modules else target)
    return out


def import_graph() -> tuple[dict, list]:
    """({module: {imported mia modules}}, [(file, line, statement) of function-level imports of mia modules]): read
    once per process (four tests ask), fresh containers each call."""
    graph, local = _read_import_graph()
    return {k: set(v) for k, v in graph.items()}, list(local)


@functools.lru_cache(maxsize=1)
def _read_import_graph() -> tuple[dict, list]:
    modules = all_modules()
    graph, local = {}, []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        is_package = path.name == "__init__.py"
        edges = set()
        top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                targets = [t for t in resolve(node, name, is_package, modules) if t != name]
                edges.update(targets)
                if targets and id(node) not in top and not _guarded_top_level(tree, node):
                    local.append((path, node.lineno))
        graph[name] = edges
    return graph, local


def _guarded_top_level(tree, node) -> bool:
    """An import inside a top-level ``if``/``try`` (still module level)."""
    for top in tree.body:
        if isinstance(top, (ast.If, ast.Try)) and any(n is node for n in ast.walk(top)):
            return True
    return False


def find_cycle(graph: dict):
    """One circle of ``graph`` as a list of modules, or None."""
    state, stack = {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if state.get(m) is None:
                found = visit(m)
                if found:
                    return found
        state[n] = 2
        stack.pop()
        return None

    for n in sorted(graph):
        if state.get(n) is None:
            found = visit(n)
            if found:
                return found
    return None


def test_the_import_graph_of_mia_has_no_circle():
    graph, _ = import_graph()
    assert len(graph) > 50 and graph["mia.api"]  # the graph was read
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_local_imports_of_mia_modules_say_why():
    _, local = import_graph()
    missing = []
    for path, line in local:
        text = path.read_text(encoding="utf-8").splitlines()[line - 1]
        if "#" not in text:
            missing.append(f"{path.relative_to(ROOT)}:{line}: {text.strip()}")
    assert missing == [], "function-level imports of mia modules without a reason:\n" + "\n".join(missing)


@pytest.mark.parametrize("graph, cycle", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ({"a": {"a"}}, ["a", "a"]),
])
def test_the_cycle_finder_finds_cycles(graph, cycle):
    assert find_cycle(graph) == cycle


def test_relative_imports_resolve_to_modules():
    modules = all_modules()
    tree = ast.parse("from ..engine import loop\nfrom .registry import get\nfrom .. import validate as V\n")
    got = [resolve(n, "mia.attacks.mink", False, modules) for n in tree.body]
    assert got == [["mia.engine.loop"], ["mia.attacks.registry"], ["mia.validate"]]


# The floors of mia, from the bottom: every package and top-level module has one, and an import may only point to
# its own floor or one below (a circle within a floor is caught by the circle test). docs/architecture.md shows the
# same list with one line of what each floor is for.
FLOORS = (
    ("mia.version", "mia.validate", "mia.offline", "mia.flops", "mia.sharding"),  # foundations
    ("mia.files",),  # files on disk: atomic writes, memoised hashes, the caches' size limit
    ("mia.metrics", "mia.privacy", "mia.report", "mia.results", "mia.documents"),  # statistics of scores: ROC,
    # privacy bounds, tables, plots (no model)
    ("mia.models",),  # model families, loading, attention kernels
    ("mia.data", "mia.engine"),  # examples and splits; the scoring engine
    ("mia.attacks", "mia.blind", "mia.entry"),  # attacks; blind baselines; what every entry point shares
    ("mia.testbed", "mia.doctor"),  # the embedded testbed; mia doctor
    ("mia.api", "mia.checkpoints"),  # the Python API; checkpoint finding
    ("mia.cli", "mia", "mia.__main__"),  # the command line and the package's own namespace
)


def floor_of(module: str, floors=FLOORS) -> int:
    """The floor of a module: that of the longest listed unit it is or lies in; KeyError when none."""
    best = None
    for level, units in enumerate(floors):
        for unit in units:
            if module == unit or (unit != "mia" and module.startswith(unit + ".")):
                if best is None or len(unit) > len(best[1]):
                    best = (level, unit)
    if best is None:
        raise KeyError(module)
    return best[0]


def upward_imports(graph: dict, floors=FLOORS) -> list:
    """(importer, imported) pairs of ``graph`` whose target lies on a higher floor than the importer."""
    return sorted((a, b) for a, targets in graph.items() for b in targets if floor_of(b, floors) > floor_of(a, floors))


def test_every_module_has_a_floor():
    graph, _ = import_graph()
    unplaced = []
    for name in graph:
        try:
            floor_of(name)
        except KeyError:
            unplaced.append(name)
    assert unplaced == [], f"add these to FLOORS in tests/test_imports.py and docs/architecture.md: {unplaced}"


def test_every_import_points_down_the_floors():
    graph, _ = import_graph()
    assert upward_imports(graph) == []


def test_the_floor_check_sees_an_upward_import():
    graph = {"mia.engine.plan": {"mia.attacks.mope", "mia.models.hub"}, "mia.models.hub": {"mia.engine.loop",
                                                                                           "mia.sharding"},
             "mia.metrics": {"mia.report"}, "mia.sharding": {"mia.models.common"}, "mia.cli": {"mia.api"}}
    assert upward_imports(graph) == [("mia.engine.plan", "mia.attacks.mope"), ("mia.models.hub", "mia.engine.loop"),
                                     ("mia.sharding", "mia.models.common")]
    assert floor_of("mia") == floor_of("mia.cli") > floor_of("mia.api") and floor_of("mia.models.hub") == 3
    with pytest.raises(KeyError):
        floor_of("mia.nowhere")


def private_names_imported_across_modules(sources: dict) -> list:
    """``module:line name`` of every ``from X import _name`` in ``sources`` ({module: source text}) where X is
    another module of mia: a private name is its module's own. (Private *modules* such as ``attacks._texts`` may
    be imported by their own package; a dunder is not private.)"""
    modules = {**all_modules(), **{m: None for m in sources}}
    found = []
    for name, text in sorted(sources.items()):
        tree = ast.parse(text)
        is_package = modules.get(name) is not None and modules[name].name == "__init__.py"
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            for alias, target in zip(node.names, resolve(node, name, is_package, modules)):
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private and target != name and not target.endswith("." + alias.name):
                    found.append(f"{name}:{node.lineno} {alias.name}")
    return found


def test_no_private_name_is_imported_across_modules():
    sources = {name: path.read_text(encoding="utf-8") for name, path in all_modules().items()}
    assert private_names_imported_across_modules(sources) == []


def test_the_private_import_check_sees_one():
    planted = {"mia.engine.plan": "from ..models.hub import Model, _dtypes\n",
               "mia.attacks.lowercase": "from . import _texts\nfrom ._texts import texts_stats\n"
                                        "from ..metrics import __doc__\n",
               "mia.privacy.gdp": "from ..metrics import _check as check\n"}
    assert private_names_imported_across_modules(planted) == ["mia.engine.plan:1 _dtypes", "mia.privacy.gdp:1 _check"]


def private_imports_of_mia(paths) -> list:
    """``file:line name`` of every ``from mia... import _name`` / ``mia...._name`` use in ``paths``."""
    found = []
    for path in paths:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mia"):
                found += [f"{path.name}:{node.lineno} {a.name}" for a in node.names if a.name.startswith("_")]
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                root = node.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(root, ast.Name) and root.id in ("mia", "A", "C", "report"):
                    found.append(f"{path.name}:{node.lineno} {node.attr}")
    return found


def test_experiments_use_only_public_names_of_mia():
    assert private_imports_of_mia(sorted((ROOT / "experiments").glob("*.py"))) == []


def test_no_experiment_module_is_over_600_lines():
    """An experiment is parse, build, run, report; what is library work lives in ``mia`` (docs/architecture.md)."""
    long = {p.name: n for p in sorted((ROOT / "experiments").glob("*.py"))
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 600}
    assert long == {}, f"move library work into mia or tables/report into NAME_report.py: {long}"
