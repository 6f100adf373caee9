"""The house's rules, read off the source and docs/ARCHITECTURE.md, the map they keep true:

- ``cfx/_src`` holds only packages, each a layer; a layer imports only the layers below it, in the
  order of the map's table "The layers, bottom up" (``LAYERS``, read from it: the one list);
- no import circle between files, function-local imports included (``cfx`` and ``cfx_kernels``);
- an implementation never imports the public modules that re-export it, and the kernels import no cfx;
- every kernel module names in ``__all__`` what other code imports from it;
- no two public packages import each other;
- no function longer than 80 lines, Triton kernels aside; no class longer than 200 lines
  (``LONG_CLASSES_TO_SPLIT`` aside).
"""
import ast
import collections
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAP = ROOT / "docs" / "ARCHITECTURE.md"
LAYERS_HEADING = "## The layers, bottom up"


def map_layers() -> list[str]:
    """The packages of the map's layer table, bottom to top: the first cell (`name`) of each row of
    the table under ``LAYERS_HEADING``, up to the next heading."""
    _, found, rest = MAP.read_text().partition(f"\n{LAYERS_HEADING}\n")
    section = rest.split("\n## ", 1)[0] if found else ""
    return [m.group(1) for m in re.finditer(r"^\| *`(\w+)` *\|", section, flags=re.MULTILINE)]


# bottom to top: a package may import only those before it
LAYERS = map_layers()
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 200
# Classes over MAX_CLASS_LINES still to split by idea, with their line counts when the cap came in
# (none now: the Plan's contract split Program and PlanConfig); an entry fails once its class is short.
LONG_CLASSES_TO_SPLIT: dict[str, int] = {}


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for top in ("cfx", "cfx_kernels"):
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = modules()
TREES = {name: ast.parse(path.read_text()) for name, path in MODULES.items()}


def imported(name: str, tree: ast.AST) -> set[str]:
    """The cfx modules ``name`` imports anywhere in its file (the longest module prefix of each)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            targets = [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


EDGES = {name: imported(name, tree) for name, tree in TREES.items()}


def layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if parts[:2] == ["cfx", "_src"] and len(parts) > 2 else None


def test_src_holds_only_layer_packages():
    src = ROOT / "cfx" / "_src"
    loose = sorted(p.name for p in src.glob("*.py") if p.name != "__init__.py")
    assert not loose, f"modules at cfx/_src's root: {loose}; put each in the layer package it belongs to"
    packages = sorted(p.name for p in src.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    where = f"{MAP.relative_to(ROOT)}'s table under {LAYERS_HEADING!r}"
    assert LAYERS, f"no layers read from {where} (one row per cfx/_src package, `name` first, bottom to top)"
    twice = sorted(n for n, k in collections.Counter(LAYERS).items() if k > 1)
    assert not twice, f"{where} lists {twice} more than once"
    missing, extra = sorted(set(packages) - set(LAYERS)), sorted(set(LAYERS) - set(packages))
    assert not missing, f"cfx/_src packages missing from {where}: {missing}; add a row for each where it sits"
    assert not extra, f"{where} lists {extra}, which are no cfx/_src packages; drop or rename the rows"


def test_layers_import_only_downward():
    wrong = []
    for a, targets in EDGES.items():
        for b in targets:
            la, lb = layer(a), layer(b)
            if la in LAYERS and lb in LAYERS and LAYERS.index(lb) > LAYERS.index(la):  # (others: see above)
                wrong.append(f"{a} ({la}) imports {b} ({lb}), a layer above it (a later row)")
    assert not wrong, (f"layers importing upward in the order of {MAP.relative_to(ROOT)}'s table under "
                       f"{LAYERS_HEADING!r} (fix the import, or the table's order if it is wrong):\n" + "\n".join(wrong))


# What a model is made of knows nothing of where a Plan keeps its state: ZeRO's pieces, Gemini's tiers,
# the Plan itself. A model with frozen weights meets the Plan through models/frozen.py's two hooks.
PLACEMENT = ("zero", "gemini", "plan")
MODEL_SIDE = ("nn", "models", "lora")


def test_models_and_lora_know_nothing_of_placement():
    wrong = sorted(f"{a} imports {b}" for a, targets in EDGES.items() if layer(a) in MODEL_SIDE
                   for b in targets if layer(b) in PLACEMENT)
    assert not wrong, ("the model side imports where a Plan keeps state (move the placement into plan/, "
                       "behind models.frozen's hooks):\n" + "\n".join(wrong))


def test_no_import_circles_between_files():
    index, low, stack, on, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in EDGES[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in EDGES:
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_implementations_never_import_the_public_modules():
    up = sorted(f"{a} -> {b}" for a, bs in EDGES.items() for b in bs
                if (layer(a) or a.startswith("cfx_kernels")) and b.startswith("cfx") and not layer(b)
                and not b.startswith("cfx_kernels") and b != "cfx._src")
    assert not up, "implementations importing public modules (import the cfx._src module instead):\n" + "\n".join(up)
    kernels = sorted(f"{a} -> {b}" for a, bs in EDGES.items() if a.startswith("cfx_kernels") for b in bs
                     if b.startswith("cfx."))
    assert not kernels, f"cfx_kernels stands alone: {kernels}"


def _defined(tree: ast.Module) -> dict[str, ast.AST]:
    """A module's top-level names: functions, classes, assigned and imported names."""
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update((a.asname or a.name.partition(".")[0], node) for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                for n in ast.walk(target):
                    if isinstance(n, ast.Name):
                        out[n.id] = node
    return out


def test_kernel_modules_name_their_public_functions():
    # each cfx_kernels module's __all__: names it defines, and every public name imported from it
    listed, wrong = {}, []
    for name, tree in TREES.items():
        if not name.startswith("cfx_kernels"):
            continue
        node = _defined(tree).get("__all__")
        if node is None:
            wrong.append(f"{name} has no __all__")
            continue
        listed[name] = set(ast.literal_eval(node.value))
        wrong += [f"{name}.__all__ names {n!r}, which it does not define"
                  for n in sorted(listed[name] - set(_defined(tree)))]
    importers = list(TREES.items()) + [(p.stem, ast.parse(p.read_text())) for p in sorted((ROOT / "cfx_tests").glob("*.py"))]
    for who, tree in importers:
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in listed:
                wrong += [f"{who} imports {a.name} from {node.module}, whose __all__ does not list it"
                          for a in node.names if not a.name.startswith("_") and a.name not in listed[node.module]
                          and f"{node.module}.{a.name}" not in MODULES]  # (not a submodule)
    assert not wrong, "\n".join(sorted(set(wrong)))


def test_no_two_public_packages_import_each_other():
    def package(m: str) -> str:
        return m if (MODULES[m].name == "__init__.py") else m.rpartition(".")[0]
    pkg_edges = collections.defaultdict(set)
    for a, bs in EDGES.items():
        if layer(a) or a.startswith("cfx_kernels"):
            continue
        for b in bs:
            if not layer(b) and package(a) != package(b):
                pkg_edges[package(a)].add(package(b))
    pairs = sorted({tuple(sorted((a, b))) for a, bs in pkg_edges.items() for b in bs if a in pkg_edges.get(b, ())})
    assert not pairs, f"packages importing each other: {pairs}"


def _is_triton_kernel(fn: ast.FunctionDef) -> bool:
    return any("jit" in ast.unparse(d) for d in fn.decorator_list) and fn.name.startswith("_")


def _lengths(top: str, kinds: tuple) -> list[tuple[str, ast.AST, int]]:
    """The ``kinds`` nodes of the ``top`` tree's files: dotted name, node, length in lines."""
    return [(f"{name}.{node.name}", node, node.end_lineno - node.lineno + 1)
            for name, tree in TREES.items() if name.startswith(top)
            for node in ast.walk(tree) if isinstance(node, kinds)]


@pytest.mark.parametrize("top", ["cfx", "cfx_kernels"])
def test_no_function_over_80_lines(top):
    long = [f"{key}: {n} lines" for key, node, n in _lengths(top, (ast.FunctionDef, ast.AsyncFunctionDef))
            if n > MAX_FUNCTION_LINES and not _is_triton_kernel(node)]
    assert not long, "split these by idea:\n" + "\n".join(long)


@pytest.mark.parametrize("top", ["cfx", "cfx_kernels"])
def test_no_class_over_200_lines(top):
    long, seen = [], set()
    for key, _, n in _lengths(top, (ast.ClassDef,)):
        if key in LONG_CLASSES_TO_SPLIT:
            seen.add(key)
            if n <= MAX_CLASS_LINES:
                long.append(f"{key}: {n} lines now; drop it from LONG_CLASSES_TO_SPLIT")
        elif n > MAX_CLASS_LINES:
            long.append(f"{key}: {n} lines")
    if top == "cfx":
        long += [f"{key}: listed in LONG_CLASSES_TO_SPLIT but not found; drop it from there"
                 for key in sorted(set(LONG_CLASSES_TO_SPLIT) - seen)]
    assert not long, "split these by idea:\n" + "\n".join(long)
