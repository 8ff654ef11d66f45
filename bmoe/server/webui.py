"""The chat page at `/`: three hand-written static files (bmoe/server/static/) shipped in the package
and served as they are: no framework, no build step, nothing fetched from another origin (the
Content-Security-Policy says so to the browser). The page talks to the server's own API only:
`/v1/chat/completions` (streamed) and `/v1/bmoe/events` (bmoe.server.events), with the API key,
if any, sent as a header (it asks for it once and keeps it in the browser's localStorage).

The files are public (no key needed, nothing secret in them); `bmoe-server --no-webui` leaves
these routes out, so `/` is a 404.

Three more public files answer what a browser that used llama-server's web UI at the same address asks
for, so it moves to this page instead of showing that UI from its cache: `/sw.js`, a service worker
that removes itself and reloads its tabs (served with or without the page, as llama-server serves it
when its own UI is off); with the page, `/manifest.webmanifest` (an installed app's manifest, now
naming this page) and `/_app/version.json` (the version llama-server's UI polls to reload itself when
the server's changed: bmoe's).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from importlib import metadata, resources

from fastapi import FastAPI
from fastapi.responses import Response

# route -> (file in bmoe/server/static, media type)
PAGES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/webui/chat.js": ("chat.js", "text/javascript; charset=utf-8"),
    "/webui/chat.css": ("chat.css", "text/css; charset=utf-8"),
    "/manifest.webmanifest": ("manifest.webmanifest", "application/manifest+json"),
}
WORKER = ("/sw.js", "sw.js", "text/javascript; charset=utf-8")  # served with or without the page
VERSION_FILE = "/_app/version.json"
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def _page(body: bytes, media: str) -> Callable[[], Awaitable[Response]]:
    async def page() -> Response:
        return Response(body, media_type=media, headers=HEADERS)

    return page


def add_pages(app: FastAPI, page: bool) -> None:
    """Serve the page's files (read once, here) at their routes when `page`, and the worker that removes
    itself either way."""
    static = resources.files("bmoe.server") / "static"
    route, name, media = WORKER
    app.get(route, include_in_schema=False)(_page((static / name).read_bytes(), media))
    if not page:
        return
    for route, (name, media) in PAGES.items():
        app.get(route, include_in_schema=False)(_page((static / name).read_bytes(), media))
    version = json.dumps({"version": f"bmoe-{metadata.version('bmoe')}"}).encode()
    app.get(VERSION_FILE, include_in_schema=False)(_page(version, "application/json"))
