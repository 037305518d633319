"""The wheel: built from the tree, installed in a fresh venv, and run from its installed files.

An editable install (`make install`) reads the source tree, so it cannot show a module the
wheel left out. Here the wheel is built from a clean copy of the tree, without build isolation
(nothing is downloaded), and installed with `--no-deps` into a fresh venv. That venv borrows
the dependencies of the running venv through a `.pth` line naming its site-packages: torch and
the rest are not installed again, the fresh site-packages comes first on the path, and the
running venv's editable `tessera` stays inactive there (a `.pth` file inside a directory that a
`.pth` line added is never processed). Every check then asks where each module came from.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

from tessera.peer.cli.demo import LocalSwarm
from tessera.peer.cli.main import main
from tests.conftest import FRANCE

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGE_DIR: dict[str, str] = PYPROJECT["tool"]["setuptools"]["package-dir"]
VERSION = PYPROJECT["project"]["version"]

# Run by the fresh venv's Python: every module of the installed distribution, imported from its
# files, and the distribution's own requirements checked against what the path offers.
INSPECT_INSTALL = r"""
import importlib, importlib.metadata as md, json, sys, sysconfig
from pathlib import Path
from packaging.requirements import Requirement

site = Path(sysconfig.get_path("purelib")).resolve()
dist = md.distribution("tessera")
modules = sorted(
    ".".join(f.with_suffix("").parts[:-1] if f.name == "__init__.py" else f.with_suffix("").parts)
    for f in map(Path, map(str, dist.files)) if f.suffix == ".py")
elsewhere = {}
for name in modules:
    file = Path(importlib.import_module(name).__file__).resolve()
    if not file.is_relative_to(site):
        elsewhere[name] = str(file)
unmet = []
for text in dist.requires or []:
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # an extra's requirement (dev)
    try:
        found = md.version(req.name)
    except md.PackageNotFoundError:
        found = None
    if found is None or not req.specifier.contains(found, prereleases=True):
        unmet.append(f"{text} (found {found})")
from tessera.peer.cli.main import installed_version  # what `tessera --version` prints after "tessera "
print(json.dumps({"location": str(Path(str(dist.locate_file(""))).resolve()), "site": str(site),
                  "version": dist.version, "cli_version": installed_version(), "modules": modules,
                  "elsewhere": elsewhere, "unmet": unmet}))
"""


def tree_files() -> dict[str, Path]:
    """Every file the package folders ship (their path inside the wheel -> the source file)."""
    files = {}
    for name, folder in PACKAGE_DIR.items():
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                files["/".join([*name.split("."), *path.relative_to(ROOT / folder).parts])] = path
    return files


def clean_copy(into: Path) -> Path:
    """The tree as a fresh clone has it: the build files and the package folders, no caches and no
    build/ left from an earlier build (setuptools would put its stale files in the wheel)."""
    into.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, into / name)
    for folder in PACKAGE_DIR.values():
        shutil.copytree(ROOT / folder, into / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return into


# No PYTHONPATH for anything the fresh venv runs: only the installation may answer an import.
CLEAN_ENV = {**os.environ, "PYTHONPATH": ""}


def run(cmd: list, *, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=CLEAN_ENV)
    assert done.returncode == 0, f"{' '.join(map(str, cmd))[:300]} failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    return done


class InstalledSwarm(LocalSwarm):
    """Peer processes run by the fresh venv's Python (`-P`: nothing but the installation is on its path)."""

    def __init__(self, python: Path, **kwargs) -> None:
        super().__init__(**kwargs)
        self.python = python

    def launcher(self, i: int) -> list[str]:
        return [str(self.python), "-P"]


def test_version_is_the_distributions(capsys: pytest.CaptureFixture[str]) -> None:
    """`tessera --version` (the installed wheel's answer is checked below, without a process of its own)."""
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"tessera {VERSION}"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("wheel")
    src = clean_copy(work / "src")
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "-w", work / "dist", src], cwd=work)
    (built,) = (work / "dist").glob("tessera-*.whl")
    return built


@pytest.fixture(scope="module")
def fresh_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("venv") / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=venv.parent)
    python = venv / "bin" / "python"
    run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel],
        cwd=venv.parent)
    site = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                    cwd=venv.parent).stdout.strip())
    borrowed = dict.fromkeys([sysconfig.get_path("purelib"), sysconfig.get_path("platlib")])
    (site / "zz_borrowed_dependencies.pth").write_text("".join(f"{path}\n" for path in borrowed))
    return venv


def test_the_wheel_holds_every_module_and_file_of_the_tree(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = tree_files()
    assert any(name.endswith(".tcss") for name in expected)  # package data is part of the check
    assert sorted(set(expected) - names) == []
    ours = {n for n in names if not n.startswith("tessera-")}
    assert sorted(ours - set(expected)) == []  # and nothing else: no tests, benches or stale build files


def test_the_installed_wheel_imports_every_module_from_its_own_files(fresh_venv: Path) -> None:
    python = fresh_venv / "bin" / "python"
    found = json.loads(run([python, "-P", "-c", INSPECT_INSTALL], cwd=fresh_venv).stdout)
    assert Path(found["location"]) == Path(found["site"])  # the wheel's metadata, not the editable one
    assert found["version"] == found["cli_version"] == VERSION
    expected = sorted(".".join(Path(p).with_suffix("").parts[:-1] if p.endswith("/__init__.py")
                               else Path(p).with_suffix("").parts) for p in tree_files() if p.endswith(".py"))
    assert found["modules"] == expected
    assert found["elsewhere"] == {}
    assert found["unmet"] == []


@pytest.mark.slow
def test_the_installed_command_runs_a_one_peer_swarm(fresh_venv: Path, smol_dir: Path, tmp_path: Path) -> None:
    tessera = fresh_venv / "bin" / "tessera"  # the console script the wheel installed
    assert "generate" in run([tessera, "--help"], cwd=tmp_path).stdout
    swarm = InstalledSwarm(fresh_venv / "bin" / "python", n=1, model=str(smol_dir), base_dir=tmp_path, env={"PYTHONPATH": ""},
                           extra_args=[["--layers", "0:30", "--memory", "1"]])
    try:
        (addr,) = swarm.start()
        done = run([tessera, "generate", FRANCE, "--join", addr, "--model", smol_dir, "--json", "--threads", "1",
                    "--max-tokens", "16"], cwd=tmp_path)
    finally:
        swarm.stop(timeout=15)
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["text"] == "The capital of France is Paris."
    assert [(hop["start"], hop["end"]) for hop in answer["route"]] == [(0, 30)]
