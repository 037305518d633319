"""The web view's files, served from the package's `static/` folder.

Every file is read once, at start, into a table by name: a request names a file of the
table or gets a 404, so no path a client sends ever reaches the filesystem (no `..`, no
absolute paths, no symlinks to follow). The files are small (tens of KB in all).

Every answer carries a Content-Security-Policy that lets a page load and call nothing
but this server: the browser itself enforces "no CDN, works offline", and a script a
peer's name could smuggle into a page would not run (the pages insert text, never HTML).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

STATIC_DIR = Path(__file__).resolve().parent / "static"
CONTENT_TYPES = {
    ".html": b"text/html; charset=utf-8",
    ".css": b"text/css; charset=utf-8",
    ".js": b"text/javascript; charset=utf-8",
    ".svg": b"image/svg+xml",
    ".png": b"image/png",
    ".json": b"application/json",
}
SECURITY_HEADERS = [
    (b"content-security-policy", b"default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
                                 b"connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]


@dataclass(frozen=True)
class StaticFile:
    body: bytes
    content_type: bytes
    etag: bytes  # a strong validator: the content's hash

    def headers(self) -> list[tuple[bytes, bytes]]:
        # no-cache: the browser revalidates (a 304 costs nothing), so a new version shows at once
        return [(b"content-type", self.content_type), (b"cache-control", b"no-cache"), (b"etag", self.etag),
                *SECURITY_HEADERS]


def load_static(folder: Path = STATIC_DIR) -> dict[str, StaticFile]:
    """Every file directly in `folder` whose suffix has a content type, by name."""
    files = {}
    for path in sorted(folder.iterdir()):
        kind = CONTENT_TYPES.get(path.suffix)
        if kind is None or not path.is_file():
            continue
        body = path.read_bytes()
        files[path.name] = StaticFile(body, kind, b'"' + hashlib.sha256(body).hexdigest()[:32].encode() + b'"')
    return files
