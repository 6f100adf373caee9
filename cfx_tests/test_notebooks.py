"""Every notebook runs top to bottom, and its committed .ipynb matches its jupytext .py twin.

``notebooks/*.py`` (jupytext percent format) is the source of truth; regenerate the paired
notebook with ``jupytext --to ipynb notebooks/NAME.py``.
"""
import pathlib

import pytest

jupytext = pytest.importorskip("jupytext")
nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[1] / "notebooks"
SOURCES = sorted(NOTEBOOKS.glob("*.py"))


def cells(nb):
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


def test_there_are_notebooks():
    assert SOURCES, f"no notebooks/*.py in {NOTEBOOKS}"


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_ipynb_matches_its_py_twin(source):
    paired = source.with_suffix(".ipynb")
    assert paired.exists(), f"{paired.name} is missing; run `jupytext --to ipynb {source}`"
    from_py = jupytext.read(source)
    from_ipynb = nbformat.read(paired, as_version=4)
    assert cells(from_ipynb) == cells(from_py), (
        f"{paired.name} is out of date with {source.name}; run `jupytext --to ipynb {source}`")
    assert all(not c.get("outputs") for c in from_ipynb.cells if c.cell_type == "code"), (
        f"{paired.name} is committed with outputs; regenerate it with jupytext")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_notebook_executes(source, tmp_path, monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    from traitlets.config import Config
    nb = jupytext.read(source)
    # the kernel's sockets are files under tmp_path (ipc), not TCP ports: two workers starting kernels
    # at once cannot race for a port (a CI run lost one to "Address already in use")
    ipc = Config({"KernelManager": {"transport": "ipc", "ip": str(tmp_path / "kernel")}})
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3", config=ipc,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError naming the cell if any cell raises
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
    if "plt." in source.read_text():  # plots are real outputs of the cells above them
        images = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                  if "image/png" in o.get("data", {})]
        assert images, f"{source.name} draws with matplotlib but no cell output an image"
