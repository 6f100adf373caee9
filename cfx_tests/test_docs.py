"""The documentation site (``mkdocs.yml``: the pages of docs/, the notebooks, an API reference drawn from the
docstrings) builds with no warning -- a broken link, a missing anchor, a page left out of the nav or a
docstring the reference cannot render fails it -- and its map and tour are the README's."""
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "guide"


def text(path: str) -> str:
    return (ROOT / path).read_text()


@pytest.mark.timeout(240)
def test_the_site_builds_with_no_warning(tmp_path):
    pytest.importorskip("mkdocs")
    site = tmp_path / "site"
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                         capture_output=True, text=True, timeout=220)
    warnings = [line for line in run.stderr.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert run.returncode == 0 and not warnings, run.stderr[-4000:]
    assert "pad_vocab" in (site / "api" / "models" / "index.html").read_text()  # drawn from the docstrings
    for notebook in (ROOT / "notebooks").glob("*.ipynb"):
        assert (site / "notebooks" / notebook.stem / "index.html").is_file()
    for page in GUIDE.glob("*.md"):
        assert (site / "guide" / page.stem / "index.html").is_file()


def test_every_guide_page_is_on_the_readmes_map_the_sites_and_its_nav():
    pages = {p.name for p in GUIDE.glob("*.md")}
    assert len(pages) > 10
    assert set(re.findall(r"\]\(docs/guide/([\w.]+)\)", text("README.md"))) == pages
    assert set(re.findall(r"\]\(guide/([\w.]+)\)", text("docs/index.md"))) == pages
    assert set(re.findall(r"guide/([\w.]+)", text("mkdocs.yml"))) == pages


def test_the_site_opens_with_the_readmes_tour():
    def tour(path):
        return re.search(r"```python\n(.*?)```", text(path), flags=re.S).group(1)
    assert tour("docs/index.md") == tour("README.md")
    assert len(text("README.md").splitlines()) < 100  # a map, not the manual
