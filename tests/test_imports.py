"""The import graph of ``mia/``: no circle, and a function-level import of mia's own modules only with a reason.

Every ``import`` / ``from ... import`` statement of every module counts, at the top or inside a function, so a
circle hidden behind a local import is still a circle. A local import of one of mia's modules is allowed only
with a comment on its line saying why (the CLI's fast start, a registry that imports its members).
"""
import ast
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
    """({module: {imported mia modules}}, [(file, line, statement) of function-level imports of mia modules])."""
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


# Layers, from the bottom: models (and the placement they use, mia.sharding) -> engine -> attacks -> api / cli. An
# arrow may only point down: the engine never imports an attack (an attack's planned step registers itself with
# ``mia.engine.plan``), and no model module imports the engine.
LAYER_RULES = (("mia.engine", "mia.attacks"), ("mia.models", "mia.engine"), ("mia.models", "mia.attacks"),
               ("mia.sharding", "mia.engine"), ("mia.sharding", "mia.models"))


def upward_imports(graph: dict) -> list:
    """(importer, imported) pairs of ``graph`` that break ``LAYER_RULES``."""
    within = lambda name, pkg: name == pkg or name.startswith(pkg + ".")  # noqa: E731
    return sorted((a, b) for a, targets in graph.items() for b in targets
                  for low, high in LAYER_RULES if within(a, low) and within(b, high))


def test_every_import_points_down_the_layers():
    graph, _ = import_graph()
    assert upward_imports(graph) == []


def test_the_layer_check_sees_an_upward_import():
    graph = {"mia.engine.plan": {"mia.attacks.mope"}, "mia.models.hub": {"mia.engine.loop", "mia.sharding"},
             "mia.attacks.mope": {"mia.engine.plan"}}
    assert upward_imports(graph) == [("mia.engine.plan", "mia.attacks.mope"), ("mia.models.hub", "mia.engine.loop")]


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
