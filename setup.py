"""The package list of the `tessera` distribution, found on disk (the rest is in pyproject.toml).

pyproject.toml's `package-dir` maps each top-level folder to a subpackage of `tessera`
(`tessera.peer` -> `peer/`); `tessera` has no folder of its own. setuptools' declarative
`packages.find` names what it finds after the folders it searched (`base`, not
`tessera.peer.base`) and cannot put them under a mapped name, so each mapped folder is
searched here with setuptools' own `find_packages` and its packages named under the mapping.
A new subpackage (a folder with an `__init__.py`) ships without anyone editing a list;
tests/test_packaging.py checks that the wheel holds every module and file of the tree.
"""

import tomllib
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent


def discovered_packages() -> list[str]:
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    packages = []
    for name, folder in package_dir.items():
        found = ["", *(f".{sub}" for sub in find_packages(str(ROOT / folder)))]
        packages.extend(f"{name}{sub}" for sub in found)
        # a module's `static/` folder (a web page's files, no modules) ships as a data-only package:
        # setuptools warns about data in a folder the package list does not name
        packages.extend(f"{name}{sub}.static" for sub in found
                        if (ROOT / folder / sub[1:].replace(".", "/") / "static").is_dir())
    return packages


setup(packages=discovered_packages())
