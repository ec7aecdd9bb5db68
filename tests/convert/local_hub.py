"""A local HTTP server that serves model folders through the Hugging Face Hub's file API.

The Hub cannot be reached from CI, but huggingface_hub talks HTTP to whatever `HF_ENDPOINT`
names, so the real client code (downloads, HEAD metadata, HTTP range requests) runs against this
server. It implements only what the client asks for when downloading files of a model repo:
`GET /api/models/{repo}/revision/{rev}` and `.../tree/{rev}` (file lists), `HEAD`/`GET /{repo}/resolve/{rev}/{file}`
(with `Range: bytes=a-b`), and records every request and the bytes of file data it sent.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

COMMIT = "1" * 40


@dataclass
class Served:
    """What the server sent: (method, path, range header) per request; body bytes per file."""

    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    body_bytes: dict[str, int] = field(default_factory=dict)


class LocalHub:
    """`with LocalHub({"org/name": folder}) as hub:` serves at `hub.endpoint`."""

    def __init__(self, repos: dict[str, Path]):
        self.repos = repos
        self.served = Served()
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> "LocalHub":
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                self._respond(head=True)

            def do_GET(self) -> None:
                self._respond(head=False)

            def _respond(self, head: bool) -> None:
                path = self.path.split("?")[0]
                hub.served.requests.append((self.command, path, self.headers.get("Range")))
                api = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
                if api and api.group(1) in hub.repos:
                    folder = hub.repos[api.group(1)]
                    files = sorted(p.name for p in folder.iterdir() if p.is_file())
                    body = json.dumps({"id": api.group(1), "modelId": api.group(1), "sha": COMMIT, "private": False,
                                       "siblings": [{"rfilename": f} for f in files]}).encode()
                    return self._send(200, body, {"Content-Type": "application/json", "X-Repo-Commit": COMMIT}, head)
                tree = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)", path)
                if tree and tree.group(1) in hub.repos:
                    folder = hub.repos[tree.group(1)]
                    entries = [{"type": "file", "path": p.name, "size": p.stat().st_size,
                                "oid": hashlib.sha1(p.read_bytes()).hexdigest()}
                               for p in sorted(folder.iterdir()) if p.is_file()]
                    return self._send(200, json.dumps(entries).encode(), {"Content-Type": "application/json"}, head)
                resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
                if not resolve or resolve.group(1) not in hub.repos:
                    return self._send(404, b"", {"X-Error-Code": "RepoNotFound"}, head)
                file = hub.repos[resolve.group(1)] / resolve.group(3)
                if not file.is_file():
                    return self._send(404, b"", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": COMMIT}, head)
                data = file.read_bytes()
                headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha1(data).hexdigest()}"',
                           "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
                status, body = 200, data
                wanted = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
                if wanted:
                    first = int(wanted.group(1))
                    last = min(int(wanted.group(2)) if wanted.group(2) else len(data) - 1, len(data) - 1)
                    status, body = 206, data[first:last + 1]
                    headers["Content-Range"] = f"bytes {first}-{last}/{len(data)}"
                if not head:
                    hub.served.body_bytes[file.name] = hub.served.body_bytes.get(file.name, 0) + len(body)
                self._send(status, body, headers, head, length=len(body))

            def _send(self, status: int, body: bytes, headers: dict, head: bool, length: int | None = None) -> None:
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body) if length is None else length))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

        return Handler
