"""The public API: every name that was public before the house was rearranged (issue 37) still
resolves (``public_names.txt``, read off the package before the move), every public module lists its
names in ``__all__`` and each of them resolves, and no public function carries names as attributes
(a name lives in a module: ``cfx.zero.gathered`` is ``cfx/zero.py``'s)."""
import importlib
import inspect
import pathlib
import types

import pytest

import cfx

NAMES = pathlib.Path(__file__).with_name("public_names.txt").read_text().split()
PUBLIC_MODULES = ["cfx", "cfx.amp", "cfx.autoshard", "cfx.checkpoint", "cfx.checkpoint_policies", "cfx.diffusion",
                  "cfx.diffusion.clip_text", "cfx.diffusion.schedulers", "cfx.diffusion.unet", "cfx.diffusion.vae",
                  "cfx.gemini", "cfx.generate", "cfx.lax", "cfx.lora", "cfx.memory", "cfx.models", "cfx.nn", "cfx.optim",
                  "cfx.parallel", "cfx.pipeline", "cfx.quant", "cfx.random", "cfx.remat", "cfx.testing", "cfx.tree",
                  "cfx.zero"]


def resolve(dotted: str):
    """The object a dotted public name names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def test_the_list_is_the_old_api():
    assert len(NAMES) > 300 and "cfx.zero.gathered" in NAMES and "cfx.pipeline.one_f_one_b" in NAMES


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_each_public_module_lists_what_it_exports_and_each_name_resolves(module):
    mod = importlib.import_module(module)
    assert isinstance(getattr(mod, "__all__", None), list), f"{module} has no __all__"
    missing = [n for n in mod.__all__ if not hasattr(mod, n)]
    assert not missing, f"{module}.__all__ names {missing}, which it does not define"


def test_every_name_public_before_the_move_still_resolves():
    broken = []
    for name in NAMES:
        try:
            resolve(name)
        except (AttributeError, ModuleNotFoundError) as e:
            broken.append(f"{name}: {e}")
    assert not broken, "\n".join(broken)


def test_no_public_function_carries_names_as_attributes():
    hung = []
    for module in PUBLIC_MODULES:
        mod = importlib.import_module(module)
        for n in mod.__all__:
            obj = getattr(mod, n)
            if inspect.isfunction(obj):
                extra = [a for a, v in vars(obj).items() if not a.startswith("_") and callable(v)]
                if extra:
                    hung.append(f"{module}.{n}: {extra}")
    assert not hung, "names hung on functions instead of listed in a module:\n" + "\n".join(hung)


@pytest.mark.parametrize("name", ["zero", "pipeline", "remat", "autoshard", "generate"])
def test_callable_modules_are_the_function_and_the_namespace(name):
    mod = importlib.import_module(f"cfx.{name}")
    assert isinstance(mod, types.ModuleType) and callable(mod) and getattr(cfx, name) is mod
    fn = getattr(mod, name)
    assert inspect.signature(mod) == inspect.signature(fn)


def test_old_class_names_are_the_new_classes():
    assert cfx.ReshardPlan is cfx.ReshardPath
    assert cfx.remat.RematPlan is cfx.remat.RematSolution
    assert cfx.pipeline.StagePlan is cfx.pipeline.Partition
    assert cfx.tree.tree_size is cfx.tree.size and cfx.tree.assert_tree_close is cfx.tree.assert_close
