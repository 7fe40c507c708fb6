"""The package's layers: each folder imports only from the folders below it.

The flow reads bottom-up: profiling -> planning -> scheduling -> simulation
and runtime -> splitter -> machine -> runplan -> api -> commands -> cli, with ``models``
(what is profiled and run) and the shared ``errors``/``quantities`` below
everything. Every import counts, at module level and inside functions, except
those under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import dreampipe

_ROOT = Path(dreampipe.__file__).parent
#: Lowest first; a module may import its own layer and the ones before it.
_LAYERS = (
    ("errors", "quantities"),
    ("models",),
    ("profiling",),
    ("planning",),
    ("scheduling",),
    ("simulation", "runtime"),
    ("splitter",),
    ("machine",),
    ("runplan",),
    ("api",),
    ("commands",),
    ("cli",),
)
_RANK = {part: i for i, parts in enumerate(_LAYERS) for part in parts}


def _module_name(path: Path) -> str:
    rel = path.relative_to(_ROOT.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _imports(path: Path, package: str, *, typed: bool = False) -> set[str]:
    """Every ``dreampipe.*`` module ``path`` (in ``package``) imports, outside TYPE_CHECKING
    unless ``typed``."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if (not typed and isinstance(node, ast.If)
                and "TYPE_CHECKING" in ast.unparse(node.test)):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("dreampipe"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            if not base.startswith("dreampipe"):
                continue
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if _is_module(candidate) else base)
    return found


def _is_module(name: str) -> bool:
    rel = Path(*name.split(".")[1:])
    return (_ROOT / rel).with_suffix(".py").is_file() or (_ROOT / rel / "__init__.py").is_file()


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return _RANK.get(parts[1]) if len(parts) > 1 else None


def _package(path: Path) -> str:
    name = _module_name(path)
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _graph(*, typed: bool = False) -> dict[str, set[str]]:
    return {_module_name(p): _imports(p, _package(p), typed=typed)
            for p in sorted(_ROOT.rglob("*.py"))}


def test_every_folder_has_a_layer() -> None:
    tops = {p.name.removesuffix(".py") for p in _ROOT.iterdir()
            if (p.suffix == ".py" or (p / "__init__.py").is_file()) and not p.name.startswith("_")}
    assert tops == set(_RANK)


def test_no_module_imports_a_higher_layer() -> None:
    bad = []
    for module, imported in _graph().items():
        mine = _layer(module)
        if mine is None:
            continue  # dreampipe/__init__ and __main__ sit on top
        for other in imported:
            theirs = _layer(other)
            if theirs is None or theirs > mine:
                bad.append(f"{module} imports {other}")
    assert not bad, "\n".join(sorted(bad))


def _find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` (module -> modules it imports), or [] if none.

    Every edge counts: between two modules of one folder, and from a package's
    ``__init__`` to its own modules (a module that imports its package while
    that ``__init__`` imports the module closes a cycle through it).
    """
    edges = {m: {o for o in imps if o != m} for m, imps in graph.items()}
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(node: str, path: list[str]) -> bool:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycle.extend([*path[path.index(nxt):], nxt])
                return True
            if state.get(nxt) is None and visit(nxt, [*path, nxt]):
                return True
        state[node] = 2
        return False

    for start in sorted(edges):
        if state.get(start) is None and visit(start, [start]):
            break
    return cycle


def test_no_import_cycle_not_even_a_type_only_one() -> None:
    cycle = _find_cycle(_graph(typed=True))
    assert not cycle, " -> ".join(cycle)


def test_no_two_modules_share_a_name() -> None:
    """A module's name says its layer and its idea: ``runtime/stage_module.py``, not a
    second ``stage.py``."""
    names: dict[str, list[str]] = {}
    for p in sorted(_ROOT.rglob("*.py")):
        if p.name != "__init__.py":
            names.setdefault(p.name, []).append(str(p.relative_to(_ROOT)))
    assert not {n: ps for n, ps in names.items() if len(ps) > 1}


def test_the_checks_can_fail(tmp_path: Path) -> None:
    source = tmp_path / "mod.py"
    source.write_text("from dreampipe.cli import main\nfrom .graph import Layer\n"
                      "if TYPE_CHECKING:\n    import dreampipe.jobs\n")
    assert _imports(source, "dreampipe.profiling") == {"dreampipe.cli",
                                                       "dreampipe.profiling.graph"}
    assert _layer("dreampipe.cli") > _layer("dreampipe.profiling.graph")  # type: ignore[operator]

    # an import cycle between two modules of one folder, and one through its __init__
    pkg = "dreampipe.api"
    (tmp_path / "a.py").write_text("from dreampipe.api.b import f\n")
    (tmp_path / "b.py").write_text("from .a import g\nif TYPE_CHECKING:\n    from .c import h\n")
    (tmp_path / "c.py").write_text("from dreampipe.api import Pipeline\n")
    graph = {f"{pkg}.{m}": _imports(tmp_path / f"{m}.py", pkg) for m in "abc"}
    assert _find_cycle(graph) == [f"{pkg}.a", f"{pkg}.b", f"{pkg}.a"]
    del graph[f"{pkg}.a"]
    assert _find_cycle(graph) == []  # b -> c under TYPE_CHECKING only
    typed = {f"{pkg}.{m}": _imports(tmp_path / f"{m}.py", pkg, typed=True) for m in "bc"}
    typed[pkg] = {f"{pkg}.b"}  # ... which the typed graph counts
    assert _find_cycle(typed) == [pkg, f"{pkg}.b", f"{pkg}.c", pkg]
    graph[pkg] = {f"{pkg}.c"}  # the package's __init__ imports c, which imports the package
    assert _find_cycle(graph) == [pkg, f"{pkg}.c", pkg]


def test_no_module_docstring_is_over_20_lines() -> None:
    """A module docstring says what the module owns and points to docs/design.md."""
    long = []
    for path in sorted(_ROOT.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
        if doc is not None and len(doc.splitlines()) > 20:
            long.append(f"{path.relative_to(_ROOT)}: {len(doc.splitlines())} lines")
    assert not long, "module docstrings over 20 lines:\n" + "\n".join(long)
