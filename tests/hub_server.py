"""A Hugging Face hub on the loopback interface, for huggingface_hub's real client (HF_ENDPOINT).

It answers what `bmoe.api.hub` uses: a model's info (`/api/models/ORG/REPO[/revision/REV]`), its file
tree, and files under `/ORG/REPO/resolve/REV/PATH` (HEAD and GET, with Range). It records every
request; it can require a token for a repository and cut a file's first GETs short (the client
sees the connection drop mid-file). Nothing here reaches past 127.0.0.1.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


class LoopbackHub:
    def __init__(self) -> None:
        self.repos: dict[str, dict[str, bytes]] = {}
        self.tokens: dict[str, str] = {}  # repo -> the token it needs
        self.drops: dict[str, int] = {}  # file path -> GETs still to cut short
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self._lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                hub._answer(self, head=True)

            def do_GET(self) -> None:
                hub._answer(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> LoopbackHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()

    def add(self, repo: str, files: dict[str, bytes | Path]) -> None:
        self.repos[repo] = {name: data.read_bytes() if isinstance(data, Path) else data for name, data in files.items()}

    def gets(self, path_end: str) -> list[dict[str, str]]:
        """The headers of each GET of a file whose path ends with `path_end`."""
        with self._lock:
            return [h for m, p, h in self.requests if m == "GET" and "/resolve/" in p and p.endswith(path_end)]

    @staticmethod
    def sha(repo: str) -> str:
        return hashlib.sha1(repo.encode()).hexdigest()

    # -- answers --

    def _send(self, h: BaseHTTPRequestHandler, status: int, body: bytes = b"", head: bool = False,
              headers: dict[str, str] | None = None) -> None:
        h.send_response(status)
        for k, v in {"Content-Length": str(len(body)), **(headers or {})}.items():
            h.send_header(k, v)
        h.end_headers()
        if not head:
            h.wfile.write(body)

    def _json(self, h: BaseHTTPRequestHandler, obj: object, head: bool) -> None:
        self._send(h, 200, json.dumps(obj).encode(), head, {"Content-Type": "application/json"})

    def _answer(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        path = unquote(urlparse(h.path).path)
        with self._lock:
            self.requests.append(("HEAD" if head else "GET", path, {k.lower(): v for k, v in h.headers.items()}))
        m = (re.match(r"^/api/models/([^/]+/[^/]+?)(?:/revision/[^/]+)?$", path)
             or re.match(r"^/api/models/([^/]+/[^/]+)/tree/[^/]+$", path)
             or re.match(r"^/([^/]+/[^/]+)/resolve/[^/]+/(.+)$", path))
        repo = m.group(1) if m else ""
        files = self.repos.get(repo)
        need = self.tokens.get(repo)
        if files is None or (need and h.headers.get("Authorization") != f"Bearer {need}"):
            self._send(h, 401, b'{"error": "Repository not found"}', head,
                       {"X-Error-Code": "RepoNotFound", "Content-Type": "application/json"})
            return
        sha = self.sha(repo)
        if path.startswith("/api/") and "/tree/" in path:
            self._json(h, [{"type": "file", "path": f, "size": len(d), "oid": hashlib.sha1(d).hexdigest(),
                            "lfs": {"oid": hashlib.sha256(d).hexdigest(), "size": len(d), "pointerSize": 134}}
                           for f, d in files.items()], head)
        elif path.startswith("/api/"):
            self._json(h, {"id": repo, "sha": sha, "private": bool(need),
                           "siblings": [{"rfilename": f} for f in files]}, head)
        else:
            self._file(h, repo, sha, m.group(2), head)

    def _file(self, h: BaseHTTPRequestHandler, repo: str, sha: str, name: str, head: bool) -> None:
        data = self.repos[repo].get(name)
        if data is None:
            self._send(h, 404, b'{"error": "Entry not found"}', head,
                       {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": sha})
            return
        meta = {"X-Repo-Commit": sha, "ETag": f'"{hashlib.sha256(data).hexdigest()}"', "Accept-Ranges": "bytes"}
        rng = re.match(r"bytes=(\d+)-$", h.headers.get("Range", ""))
        start = int(rng.group(1)) if rng else 0
        body = data[start:]
        if head:
            self._send(h, 200, data, True, meta)
            return
        status, extra = (206, {"Content-Range": f"bytes {start}-{len(data) - 1}/{len(data)}"}) if rng else (200, {})
        with self._lock:
            cut = self.drops.get(name, 0) > 0
            if cut:
                self.drops[name] -= 1
        if not cut:
            self._send(h, status, body, False, {**meta, **extra})
            return
        h.send_response(status)  # announce it all, send half, hang up
        for k, v in {"Content-Length": str(len(body)), **meta, **extra}.items():
            h.send_header(k, v)
        h.end_headers()
        h.wfile.write(body[:len(body) // 2])
        h.wfile.flush()
        h.close_connection = True
        h.connection.shutdown(2)
