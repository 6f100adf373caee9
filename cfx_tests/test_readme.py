"""The README's code blocks, and those of the guide's pages (docs/guide: the README's long sections), run as
written, so the docs cannot rot."""
import pathlib
import re
import sys
import types

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs" / "guide").glob("*.md"))]


def python_blocks():
    """``(page, code)`` of every python block, the README's first."""
    return [(page, code) for page in PAGES for code in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)]


def test_readme_opens_with_the_two_commands():
    first_block = re.search(r"```sh\n(.*?)```", README.read_text(), flags=re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first_block.strip().splitlines()]
    assert commands == ["make demo", "make test"]


def test_readme_python_blocks_run(tmp_path, monkeypatch, capsys):
    blocks = python_blocks()
    assert blocks, "README has no python blocks"
    monkeypatch.chdir(tmp_path)
    assert len({page for page, _ in blocks}) > 10  # the guide's pages have theirs
    for page, code in blocks:
        code = code.replace("/tmp/cfx-tour.safetensors", str(tmp_path / "tour.safetensors"))
        module = types.ModuleType("readme")  # importable, as torch.compile expects of a function's module
        monkeypatch.setitem(sys.modules, "readme", module)
        exec(compile(code, str(page), "exec"), module.__dict__)
    out = capsys.readouterr().out
    losses = [float(line.split()[1]) for line in out.splitlines() if re.fullmatch(r"\d+ [\d.]+", line)]
    assert len(losses) == 3 and losses[-1] < losses[0]


def test_every_optimizer_update_in_the_readme_is_applied():
    # a block that computes updates and never applies them trains nothing when copied
    for page, code in python_blocks():
        for name in re.findall(r"^\s*(\w+), \w+ = \w+\.update\(", code, flags=re.M):
            assert re.search(rf"apply_updates\([^)]*\b{name}\b", code), f"{page.name}: {name!r} is never applied:\n{code}"
