"""What ``pip install cfx`` installs is what cfx imports: every third-party module the package imports
(outside the benches) is a base dependency in pyproject.toml, or belongs to a named extra that declares it
(a plain install once trained to the end and lost the run to a missing ``safetensors`` at save time)."""
import ast
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
# import name -> (the extra that declares it, its distribution name)
OPTIONAL = {"lightning": ("lightning", "lightning"), "starlette": ("serve", "starlette"),
            "uvicorn": ("serve", "uvicorn"), "prometheus_client": ("serve", "prometheus_client"),
            "transformers": ("hf", "transformers"), "PIL": ("diffusion", "pillow"),
            "hypothesis": ("testing", "hypothesis"), "matplotlib": ("plots", "matplotlib")}


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("-", "_")


def third_party_imports() -> dict[str, str]:
    """Top-level module -> one file of ``cfx/`` (benches excluded) that imports it."""
    out = {}
    for path in sorted((ROOT / "cfx").rglob("*.py")):
        if "bench" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                    [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            for mod in mods:
                top = mod.split(".")[0]
                if top not in sys.stdlib_module_names and top not in ("cfx", "cfx_kernels", "__future__"):
                    out.setdefault(top, str(path.relative_to(ROOT)))
    return out


def test_every_import_is_a_dependency_or_a_named_extras():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {_name(r) for r in project["dependencies"]}
    extras = {k: {_name(r) for r in v} for k, v in project["optional-dependencies"].items()}
    assert {"safetensors", "optree", "numpy", "scipy", "tqdm", "torch", "triton"} <= base
    for mod, where in third_party_imports().items():
        if mod in OPTIONAL:
            extra, dist = OPTIONAL[mod]
            assert dist.lower() in extras.get(extra, set()), f"{where} imports {mod}: extra [{extra}] must declare {dist}"
        else:
            assert mod.lower() in base, f"{where} imports {mod}, which pyproject's dependencies do not declare"
