"""The tiny models of the family rows (rows.py), each saved and run through transformers once per
session, when a test first asks for it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .conformance import build, reference_run
from .rows import ROWS


class FamilyModels:
    """Each row's folder and transformers' reference run, made on first use."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._folders: dict[str, Path] = {}
        self._references: dict[str, tuple[list[int], list[torch.Tensor]]] = {}

    def folder(self, name: str) -> Path:
        if name not in self._folders:
            row = ROWS[name]
            self._folders[name] = build(self.root, name.replace("/", "-"), row.config(), seed=row.seed,
                                        fused=row.fused)
        return self._folders[name]

    def reference(self, name: str) -> tuple[list[int], list[torch.Tensor]]:
        if name not in self._references:
            self._references[name] = reference_run(self.folder(name), stepped=ROWS[name].stepped)
        return self._references[name]


@pytest.fixture(scope="session")
def family_models(tmp_path_factory) -> FamilyModels:
    pytest.importorskip("transformers")
    return FamilyModels(tmp_path_factory.mktemp("families"))
