"""Where tests put the screenshots the manual shows (docs/pages/images/).

Written only when ``TESSERA_SCREENSHOTS`` names a folder: `make screenshots` sets it to
docs/pages/images and runs the tests that take them (the web view's browser tests and the
TUI's main screen), so the pictures in the docs are what the tests saw, not drawn by hand.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def screenshot_dir() -> Path | None:
    """The folder to write screenshots to (created), or None when none is asked for."""
    where = os.environ.get("TESSERA_SCREENSHOTS")
    if not where:
        return None
    folder = Path(where) if Path(where).is_absolute() else ROOT / where
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def offline_svg(svg: str) -> str:
    """A Textual/Rich SVG screenshot without its web fonts: it names Fira Code on a CDN, and the
    manual loads nothing from another host; the font falls back to a local one (and monospace)."""
    return re.sub(r""",\s*url\("https?://[^"]*"\)\s*format\("[^"]*"\)""", "", svg)
