"""The package's imports follow the layers docs/ARCHITECTURE.md writes down, and no module imports itself back
through others. Every import counts: top-level, inside functions and under ``TYPE_CHECKING``, since each one
is a dependency of design even where it is deferred."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Circles still to break, each with what breaks it; a circle not listed here fails the test, and so does a listed
# one that is gone (then its entry goes too).
KNOWN_CIRCLES: dict[frozenset[str], str] = {}


def _package_dirs() -> dict[str, str]:
    """Folder -> dotted package, from pyproject's package-dir (read with a pattern: Python 3.10 has no tomllib)."""
    table = re.search(r"package-dir\s*=\s*\{([^}]*)\}", (ROOT / "pyproject.toml").read_text())
    assert table, "pyproject.toml has no package-dir"
    return {folder.strip("/"): pkg for pkg, folder in re.findall(r'"([^"]+)"\s*=\s*"([^"]*)"', table.group(1))}


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the installed package (generated protobuf files aside)."""
    out: dict[str, Path] = {}
    for folder, pkg in _package_dirs().items():
        if "." in pkg and folder == pkg.replace(".", "/"):
            continue  # a subpackage in its parent's folder: walked with the parent
        for py in (ROOT / folder).rglob("*.py"):
            if "_pb2" in py.name:
                continue
            parts = list(py.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([pkg, *parts])] = py
    return out


def _imports(path: Path, module: str) -> set[str]:
    """Every name an import statement of the file reaches: modules, and ``module.name`` for from-imports."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.add(target)
            out.update(f"{target}.{alias.name}" for alias in node.names)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the project's modules it imports (an imported name resolves to the longest module it names)."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        for target in _imports(path, mod):
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != mod:
                graph[mod].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of two or more modules (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[frozenset[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(frozenset(comp))
    return out


def documented_layers() -> list[tuple[str, list[str]]]:
    """docs/ARCHITECTURE.md's layer table, top (0) first: (layer, the paths it lists)."""
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = doc.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if re.match(r"\| \d", line)]
    return [(row.split("|")[1].strip(), re.findall(r"`([^`]+)`", row.split("|")[2])) for row in rows]


def layer_of(path: Path, layers: list[tuple[str, list[str]]]) -> int | None:
    """The layer whose longest listed path (a file, or a folder ending in /) holds ``path``."""
    rel = path.relative_to(ROOT).as_posix()
    best: tuple[int, int] | None = None  # (matched length, layer)
    for i, (_, paths) in enumerate(layers):
        for p in paths:
            if rel == p or (p.endswith("/") and rel.startswith(p)):
                if best is None or len(p) > best[0]:
                    best = (len(p), i)
    return None if best is None else best[1]


def test_the_import_graph_sees_deferred_imports():
    """The walk counts what a plain reading of top-level imports would miss: a function's own import and one
    under ``TYPE_CHECKING``."""
    graph = import_graph()
    assert "raysparse.cli.specattn_map" in graph["raysparse.cli"]  # inside ``main``
    assert "raysparse.methods.base" in graph["raysparse.methods.registry"]  # under TYPE_CHECKING
    assert "raysparse.kernels.dispatch" in graph["raysparse.methods.base"]  # through pyproject's package-dir


def test_circle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [frozenset({"a", "b", "c"})]


def test_no_import_circles():
    found = set(circles(import_graph()))
    new = [sorted(c) for c in found - set(KNOWN_CIRCLES)]
    assert not new, f"import circles: {new}"
    gone = [sorted(c) for c in set(KNOWN_CIRCLES) - found]
    assert not gone, f"these circles are broken now: take them out of KNOWN_CIRCLES: {gone}"


def test_every_module_has_a_layer_and_imports_only_its_own_or_lower_ones():
    layers = documented_layers()
    assert [name.split()[0] for name, _ in layers] == [str(i) for i in range(len(layers))], layers
    mods = _modules()
    level = {m: layer_of(path, layers) for m, path in mods.items()}
    unplaced = sorted(mods[m].relative_to(ROOT).as_posix() for m, lv in level.items() if lv is None)
    assert not unplaced, f"modules the layer table of docs/ARCHITECTURE.md does not place: {unplaced}"
    upward = [f"{m} (layer {level[m]}) imports {t} (layer {level[t]})"
              for m, targets in import_graph().items() for t in sorted(targets) if level[t] > level[m]]
    assert not upward, "imports against the layers of docs/ARCHITECTURE.md:\n" + "\n".join(upward)
