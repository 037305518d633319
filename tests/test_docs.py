"""The manual: docs/pages/ builds as a MkDocs site in strict mode, and the README's links land in it.

Strict mode with docs/mkdocs.yml's `validation` turns every broken link, missing anchor and page
left out of the nav into an error; the site is built once per module into a temporary folder.
"""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_layers import LAYER_RANK

ROOT = Path(__file__).resolve().parents[1]
README_LIMIT = 10 * 1024


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("docs") / "site"
    done = mkdocs_build(ROOT / "docs" / "mkdocs.yml", out)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}{done.stderr}"
    return out


def test_the_docs_build_in_strict_mode(site: Path) -> None:
    pages = {p.stem for p in (ROOT / "docs" / "pages").glob("*.md")}
    built = {p.stem for p in site.glob("*.html")}
    assert pages <= built, f"pages not built: {sorted(pages - built)}"


def test_a_broken_link_or_anchor_fails_the_build(tmp_path: Path) -> None:
    """The strict build can fail: a copy of the docs with one bad anchor and one bad page link."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    with open(tmp_path / "docs" / "pages" / "config.md", "a") as page:
        page.write("\n[gone](peer.md#no-such-heading) and [nowhere](no-such-page.md)\n")
    done = mkdocs_build(tmp_path / "docs" / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0
    assert "no-such-heading" in done.stderr and "no-such-page.md" in done.stderr


def test_the_built_pages_load_nothing_from_another_host(site: Path) -> None:
    """The manual reads offline: no script, stylesheet or image from a CDN."""
    remote = re.compile(r"<(?:script|link|img)\b[^>]*\b(?:src|href)=\"(?:https?:)?//[^\"]*\"")
    found = {page.name: remote.findall(page.read_text()) for page in site.glob("*.html")}
    assert {name: hits for name, hits in found.items() if hits} == {}


def test_the_readme_is_a_front_page() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= README_LIMIT
    assert "make demo" in text and "make test" in text  # the two set-up commands (.ci/run calls make test)


def test_every_readme_link_reaches_a_page_and_heading_of_the_site(site: Path) -> None:
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert any(link.startswith("docs/pages/") for link in local)
    broken = []
    for link in local:
        path, _, anchor = link.partition("#")
        if not (ROOT / path).exists():
            broken.append(f"{link}: no file {path}")
            continue
        if anchor:
            assert path.startswith("docs/pages/") and path.endswith(".md"), link
            page = site / Path(path).relative_to("docs/pages").with_suffix(".html")
            if f'id="{anchor}"' not in page.read_text():
                broken.append(f"{link}: no heading #{anchor} in {path}")
    assert broken == []


def test_the_architecture_page_names_every_layer_the_import_test_holds() -> None:
    """tests/test_layers.py enforces the layers of peer/; docs/pages/architecture.md must draw the same."""
    page = (ROOT / "docs" / "pages" / "architecture.md").read_text()
    assert "tests/test_layers.py" in page
    missing = [layer for layer in LAYER_RANK if not re.search(rf"^  {layer}/ ", page, re.M)]
    assert missing == []


DOC_IMPORT = re.compile(r"^\s*from (tessera(?:\.\w+)+) import ([\w, ]+)|`from (tessera(?:\.\w+)+) import ([\w, ]+)`"
                        r"|\bimport (tessera(?:\.\w+)+)", re.M)


def doc_imports(text: str) -> list[tuple[str, tuple[str, ...]]]:
    """(module, names) of each `from tessera... import ...` and `import tessera...` in a page."""
    found = []
    for m in DOC_IMPORT.finditer(text):
        module = m.group(1) or m.group(3) or m.group(5)
        names = m.group(2) or m.group(4) or ""
        found.append((module, tuple(n.strip() for n in names.split(",") if n.strip())))
    return found


def test_every_import_the_docs_show_resolves() -> None:
    """A reader copies the examples: a module moved (stages/ was split) must not leave a page
    importing from where it was."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs" / "pages").glob("*.md"))]
    shown = {(page.name, module, names) for page in pages for module, names in doc_imports(page.read_text())}
    assert len(shown) >= 5  # the pattern still finds the examples
    broken = []
    for page, module, names in sorted(shown):
        try:
            loaded = importlib.import_module(module)
        except ImportError as error:
            broken.append(f"{page}: {module}: {error}")
            continue
        broken += [f"{page}: {module} has no {name}" for name in names if not hasattr(loaded, name)]
    assert broken == []
    assert doc_imports("from tessera.stages.sampling import SamplingParams\n") == [
        ("tessera.stages.sampling", ("SamplingParams",))]
