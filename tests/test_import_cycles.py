"""The library's import graph has no cycle, imports nothing of ``eval/`` or ``tools/``, and no module
of it is over :data:`MAX_LINES` lines.

Every module of ``jacap_attn`` (``patches/`` as ``jacap_attn.patches``) is parsed with :mod:`ast`;
every ``import`` counts, function-local ones included, except those under ``if TYPE_CHECKING:``.
``importlib.import_module`` calls (``jacap_attn.patches`` finds its adapters so) are not seen.

How an import becomes edges (what Python runs for it):

* ``import a.b.c`` / ``from a.b.c import x`` from module X runs ``a``, ``a.b`` and ``a.b.c``: X depends
  on each of them that does not contain X (the packages that contain X are running already).
  ``from a.b import c`` where ``a.b.c`` is a module also runs ``a.b.c``.
* A package is two nodes. ``P`` is the whole ``__init__``: its own code (``P[body]``) and the
  submodules it imports (re-exports). Importing P from outside runs all of that. A module inside P
  that imports P (``from . import Adapter``, ``from .. import __version__``) depends only on
  ``P[body]`` and on the submodule each imported name comes from, so that P's re-exports of its
  own submodules do not count as dependencies of them.
"""

from __future__ import annotations

import ast
from collections import defaultdict, deque
from pathlib import Path

from conftest import library_files

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 400
FORBIDDEN = ("eval", "tools")  # the repository's benchmark and tool folders: not in the wheel
BODY = "[body]"


def _module_name(installed: str) -> str:
    """``jacap_attn/methods/__init__.py`` -> ``jacap_attn.methods``; ``jacap_attn/storage/cache.py`` -> ``jacap_attn.storage.cache``."""
    parts = installed.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _inside(module: str, package: str) -> bool:
    """Whether ``module`` is ``package`` or lies in it (so Python is running ``package`` already)."""
    return module == package or module.startswith(package + ".")


def _ancestors(module: str) -> list[str]:
    """``a.b.c`` -> ``["a", "a.b", "a.b.c"]``."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, *, type_checking: bool):
    """``(node, in_function)`` for every import statement of ``tree``; those under ``if TYPE_CHECKING:``
    only when ``type_checking``."""
    def walk(node, in_function):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, in_function
        if isinstance(node, ast.If) and _is_type_checking(node.test) and not type_checking:
            children = node.orelse
        else:
            children = ast.iter_child_nodes(node)
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in children:
            yield from walk(child, inner)

    yield from walk(tree, False)


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[tuple[str, list[str]]]:
    """``(absolute module, names imported from it)`` for one import statement of ``module``."""
    if isinstance(node, ast.Import):
        return [(alias.name, []) for alias in node.names]
    base = module if is_package else module.rpartition(".")[0]
    if node.level > 1:
        base = ".".join(base.split(".")[: 1 - node.level])
    if node.level:
        target = ".".join(filter(None, [base, node.module]))
    else:
        target = node.module
    return [(target, [alias.name for alias in node.names])]


class ImportGraph:
    """The import graph of the library in the checkout at ``root`` (see the module docstring)."""

    def __init__(self, root: Path):
        self.root = root
        self.files = {_module_name(installed): path for installed, path in library_files(root).items()}
        self.packages = {name for name, path in self.files.items() if path.name == "__init__.py"}
        self.trees = {name: ast.parse(path.read_text(encoding="utf-8"), str(path)) for name, path in self.files.items()}
        self.edges: dict[str, dict[str, list[str]]] = defaultdict(dict)  # node -> {node: ["file:line", ...]}
        self.forbidden: list[str] = []
        self.bound = {package: self._bound_names(package) for package in self.packages}
        for module, tree in self.trees.items():
            self._add_module(module, tree)

    def _where(self, module: str, node: ast.stmt, in_function: bool) -> str:
        return f"{self.files[module].relative_to(self.root)}:{node.lineno}" + (" (in a function)" if in_function else "")

    def _bound_names(self, package: str) -> dict[str, str]:
        """Names that ``package``'s ``__init__`` imports from its own submodules -> the submodule."""
        bound = {}
        for node, _ in _imports(self.trees[package], type_checking=False):
            for target, names in _targets(package, True, node):
                for name in names:
                    source = f"{target}.{name}" if f"{target}.{name}" in self.files else target
                    if source != package and _inside(source, package):
                        bound[name] = source
        return bound

    def _depends(self, module: str, target: str, names: list[str]) -> set[str]:
        """The nodes that ``module`` depends on through ``from target import names`` (``import target``
        when ``names`` is empty)."""
        found = {a for a in _ancestors(target) if a in self.files and not _inside(module, a)}
        attributes = [name for name in names if f"{target}.{name}" not in self.files]
        for name in names:
            if f"{target}.{name}" in self.files:
                found |= self._depends(module, f"{target}.{name}", [])
        if target in self.packages and _inside(module, target) and (attributes or not names):
            found.add(target + BODY)
            for name in attributes:
                if name in self.bound[target]:
                    found |= self._depends(module, self.bound[target][name], [])
        found.discard(module)
        return found

    def _add_module(self, module: str, tree: ast.AST) -> None:
        is_package = module in self.packages
        if is_package:
            self.edges[module][module + BODY] = []
        for node, in_function in _imports(tree, type_checking=True):
            for target, _ in _targets(module, is_package, node):
                if target.split(".")[0] in FORBIDDEN:
                    self.forbidden.append(f"{self._where(module, node, in_function)}: imports {target}")
        for node, in_function in _imports(tree, type_checking=False):
            for target, names in _targets(module, is_package, node):
                if target.split(".")[0] != "jacap_attn":
                    continue
                for dep in self._depends(module, target, names):
                    # A package's imports of its own submodules are its re-exports (the whole node);
                    # the rest is its body's.
                    own = _inside(dep.removesuffix(BODY), module)
                    source = module + BODY if is_package and not own else module
                    self.edges[source].setdefault(dep, []).append(self._where(module, node, in_function))

    def cycles(self) -> list[list[str]]:
        """The strongly connected components with more than one module (Tarjan), each sorted."""
        index, low, stack, on_stack, found = {}, {}, [], set(), []
        nodes = sorted(set(self.edges) | {d for deps in self.edges.values() for d in deps})

        def visit(node):
            index[node] = low[node] = len(index)
            stack.append(node)
            on_stack.add(node)
            for dep in self.edges.get(node, {}):
                if dep not in index:
                    visit(dep)
                    low[node] = min(low[node], low[dep])
                elif dep in on_stack:
                    low[node] = min(low[node], index[dep])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                modules = {member.removesuffix(BODY) for member in component}
                if len(modules) > 1:
                    found.append(sorted(component))

        for node in nodes:
            if node not in index:
                visit(node)
        return sorted(found)

    def shortest_cycle(self, component: list[str]) -> list[str]:
        """A shortest cycle through the first module of ``component``, within it (breadth first)."""
        start, members = component[0], set(component)
        parents, queue = {start: None}, deque([start])
        while queue:
            node = queue.popleft()
            for dep in sorted(self.edges.get(node, {})):
                if dep == start:
                    path = [node]
                    while parents[path[-1]] is not None:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if dep in members and dep not in parents:
                    parents[dep] = node
                    queue.append(dep)
        raise AssertionError(f"no cycle through {start}")  # pragma: no cover - a component has one

    def describe(self, component: list[str]) -> str:
        """One component: its modules, a shortest cycle, and every import inside it with file:line."""
        members = set(component)
        names = sorted({member.removesuffix(BODY) for member in component})
        example = [node.removesuffix(BODY) for node in self.shortest_cycle(component)]
        example = [name for i, name in enumerate(example) if i == 0 or name != example[i - 1]]  # P -> P[body]
        lines = [" <-> ".join(names), "  e.g. " + " -> ".join(example)]
        for node in component:
            for dep, where in sorted(self.edges.get(node, {}).items()):
                if dep in members and where:  # the package -> [body] edge is no import
                    lines.append(f"  {node.removesuffix(BODY)} -> {dep.removesuffix(BODY)}: {', '.join(where)}")
        return "\n".join(lines)


def _write_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_graph_on_a_small_tree(tmp_path):
    """The rules of the module docstring on a made-up library."""
    graph = ImportGraph(_write_tree(tmp_path, {
        "jacap_attn/__init__.py": "from .a import f\nfrom . import sub\n",  # re-exports only
        "jacap_attn/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n"
                           "from . import __version__\ndef f():\n    from .c import g\n",
        "jacap_attn/b.py": "from .a import f\n",
        "jacap_attn/c.py": "import jacap_attn.sub\n",
        "jacap_attn/sub/__init__.py": "from .d import h\n",
        "jacap_attn/sub/d.py": "from .. import f\nfrom . import h\n",
        "jacap_attn/e.py": "import tools.gpu_bench\nfrom eval import speed\n",
        "patches/__init__.py": "X = 1\n",
        "patches/llama.py": "from . import X\n",
    }))
    assert graph.edges["jacap_attn"] == {"jacap_attn[body]": [], "jacap_attn.a": ["jacap_attn/__init__.py:1"],
                                         "jacap_attn.sub": ["jacap_attn/__init__.py:2"]}
    # TYPE_CHECKING left out; `from . import __version__` is the root's body; function-local counted.
    assert set(graph.edges["jacap_attn.a"]) == {"jacap_attn[body]", "jacap_attn.c"}
    assert graph.edges["jacap_attn.a"]["jacap_attn.c"] == ["jacap_attn/a.py:6 (in a function)"]
    # From outside a package: the whole package, re-exports included. From inside: the body, and the
    # module an imported name comes from (`f`: jacap_attn.a, `h`: jacap_attn.sub.d itself, dropped).
    assert set(graph.edges["jacap_attn.c"]) == {"jacap_attn.sub"}
    assert set(graph.edges["jacap_attn.sub"]) == {"jacap_attn.sub[body]", "jacap_attn.sub.d"}
    assert set(graph.edges["jacap_attn.sub.d"]) == {"jacap_attn[body]", "jacap_attn.a", "jacap_attn.sub[body]"}
    assert set(graph.edges["jacap_attn.patches.llama"]) == {"jacap_attn.patches[body]"}
    # a -> c -> sub -> d -> a (through jacap_attn.sub's re-export of d); b -> a only.
    [cycle] = graph.cycles()
    assert {name.removesuffix(BODY) for name in cycle} == {"jacap_attn.a", "jacap_attn.c", "jacap_attn.sub",
                                                          "jacap_attn.sub.d"}
    assert "e.g. jacap_attn.a -> jacap_attn.c -> jacap_attn.sub -> jacap_attn.sub.d -> jacap_attn.a" \
        in graph.describe(cycle)
    assert graph.forbidden == ["jacap_attn/e.py:1: imports tools.gpu_bench", "jacap_attn/e.py:2: imports eval"]


def test_no_import_cycles():
    graph = ImportGraph(ROOT)
    assert len(graph.files) > 10 and "jacap_attn.patches" in graph.packages
    cycles = graph.cycles()
    assert not cycles, f"{len(cycles)} import cycle(s) in jacap_attn:\n" + "\n".join(map(graph.describe, cycles))


def test_no_eval_or_tools_imports():
    forbidden = ImportGraph(ROOT).forbidden
    assert not forbidden, "jacap_attn imports the repository's eval/ or tools/:\n" + "\n".join(forbidden)


def test_no_module_over_max_lines():
    counts = {installed: len(path.read_text(encoding="utf-8").splitlines())
              for installed, path in library_files(ROOT).items()}
    long = sorted(((count, name) for name, count in counts.items() if count > MAX_LINES), reverse=True)
    assert not long, f"modules over {MAX_LINES} lines:\n" + "\n".join(f"  {name}: {count} lines" for count, name in long)
