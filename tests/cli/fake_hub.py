"""A local HTTP server that stands in for the Hugging Face hub: the parts of its API that
`huggingface_hub` uses to download a model (repository info, the file tree, `resolve` with
HEAD and ranged GET), so that `tessera model fetch ORG/NAME` is tested with the real client
and no network (point it here with `HF_ENDPOINT`).

    GET  /api/models/ORG/NAME/revision/REV   {"id", "sha", "siblings"}: REV (a branch or a commit) resolved
    GET  /api/models/ORG/NAME/tree/REV       [{"type": "file", "path", "size", "oid", "lfs"?}, ...]
    HEAD /ORG/NAME/resolve/REV/PATH          X-Repo-Commit, ETag (git blob sha1, or X-Linked-Etag: the
                                             sha256 of an LFS file), Content-Length
    GET  /ORG/NAME/resolve/REV/PATH          the bytes (206 from a `Range: bytes=N-` or `bytes=N-M`)

Errors carry the hub's `X-Error-Code` (RepoNotFound, RevisionNotFound, EntryNotFound), which
the client turns into its typed errors. Every request is logged (`requests`); `cut_once` makes
the first GET of a file stop half-way, as a dropped connection does; `tamper` serves other
bytes than the tree lists for a file (same size: its last 16 bytes flipped, inside the data of
a safetensors file's last tensor, so its header still reads), as a corrupt mirror would.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

LFS_SUFFIXES = (".safetensors", ".bin", ".onnx", ".gguf")  # stored in git-LFS on the hub


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit -> path -> bytes
    refs: dict[str, str] = field(default_factory=dict)  # branch -> commit


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self.cut_once: set[str] = set()  # file paths whose first GET stops half-way
        self.tamper: set[str] = set()  # file paths served with other bytes than listed
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "FakeHub":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def add(self, repo: str, files: dict[str, bytes] | Path, *, branch: str = "main") -> str:
        """Commit `files` (a folder's files, or a mapping) to `repo` on `branch`; returns the commit."""
        if isinstance(files, Path):
            files = {p.name: p.read_bytes() for p in sorted(files.iterdir()) if p.is_file()}
        commit = hashlib.sha1(repr(sorted((k, hashlib.sha256(v).hexdigest()) for k, v in files.items()))
                              .encode()).hexdigest()
        entry = self.repos.setdefault(repo, Repo())
        entry.commits[commit] = dict(files)
        entry.refs[branch] = commit
        return commit

    def gets(self, path_suffix: str) -> list[str | None]:
        """The Range headers of every GET of a file whose URL ends with `path_suffix`."""
        return [r for m, p, r in self.requests if m == "GET" and "/resolve/" in p and p.endswith(path_suffix)]

    # -- the handler ---------------------------------------------------------------------

    def _resolve(self, repo: str, revision: str) -> tuple[str, dict[str, bytes]] | str:
        entry = self.repos.get(repo)
        if entry is None:
            return "RepoNotFound"
        commit = entry.refs.get(revision, revision)
        if commit not in entry.commits:
            return "RevisionNotFound"
        return commit, entry.commits[commit]

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                self.serve(body=False)

            def do_GET(self) -> None:
                self.serve(body=True)

            def fail(self, status: int, code: str) -> None:
                payload = json.dumps({"error": code}).encode()
                self.send_response(status)
                self.send_header("X-Error-Code", code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def json(self, obj) -> None:
                payload = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def serve(self, *, body: bool) -> None:
                path = unquote(urlparse(self.path).path)
                hub.requests.append((self.command, path, self.headers.get("Range")))
                api = re.fullmatch(r"/api/models/([^/]+/[^/]+)/(revision|tree)/([^/]+)(?:/.*)?", path)
                resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
                if api:
                    found = hub._resolve(api[1], api[3])
                    if isinstance(found, str):
                        return self.fail(404, found)
                    commit, files = found
                    if api[2] == "revision":
                        return self.json({"id": api[1], "modelId": api[1], "sha": commit, "private": False,
                                          "siblings": [{"rfilename": name} for name in sorted(files)]})
                    return self.json([self.entry(name, data) for name, data in sorted(files.items())])
                if resolve:
                    found = hub._resolve(resolve[1], resolve[2])
                    if isinstance(found, str):
                        return self.fail(404, found)
                    commit, files = found
                    if resolve[3] not in files:
                        return self.fail(404, "EntryNotFound")
                    return self.file(commit, resolve[3], files[resolve[3]], body=body)
                self.fail(404, "RepoNotFound")

            def entry(self, name: str, data: bytes) -> dict:
                out = {"type": "file", "path": name, "size": len(data), "oid": git_blob_sha1(data)}
                if name.endswith(LFS_SUFFIXES):
                    out["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
                return out

            def file(self, commit: str, name: str, data: bytes, *, body: bool) -> None:
                size = len(data)
                etag = hashlib.sha256(data).hexdigest() if name.endswith(LFS_SUFFIXES) else git_blob_sha1(data)
                if name in hub.tamper:
                    data = data[:-16] + bytes(b ^ 0xFF for b in data[-16:])
                start = 0
                wanted = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
                if wanted:
                    start = min(int(wanted[1]), len(data))
                    if wanted[2]:  # inclusive, as HTTP has it
                        data = data[: max(start, min(len(data), int(wanted[2]) + 1))]
                self.send_response(206 if wanted else 200)
                self.send_header("X-Repo-Commit", commit)
                self.send_header("ETag", f'"{etag}"')
                if name.endswith(LFS_SUFFIXES):
                    self.send_header("X-Linked-Etag", f'"{etag}"')
                    self.send_header("X-Linked-Size", str(size))
                if wanted:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{size}")
                self.send_header("Content-Length", str(len(data) - start))
                self.send_header("Accept-Ranges", "bytes")
                self.end_headers()
                if not body:
                    return
                if name in hub.cut_once and not wanted:
                    hub.cut_once.discard(name)
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True  # the rest never comes: the client must resume
                    return
                self.wfile.write(data[start:])

        return Handler
