"""A small Hugging Face Hub on 127.0.0.1 for the hub tests: the endpoints huggingface_hub 2.4 calls to download a
snapshot of a model or a dataset (repo info, tree listing, resolve) and to upload a folder without LFS (create repo, preupload, commit).

Repos are folders of files held in memory (a dataset's under the key "datasets/OWNER/NAME"); each revision is one commit (a sha1 of the files). Every request is
logged (method, path, Authorization header) so a test can count downloads and check the token. Use it as a context
manager: the server thread stops when the block ends.
"""
from __future__ import annotations

import base64
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, dict[str, bytes]] = {}
        self.log: list[tuple[str, str, str | None]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def add_folder(self, repo: str, folder: Path) -> None:
        self.repos[repo] = {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
                            if p.is_file()}

    def commit(self, repo: str) -> str:
        digest = hashlib.sha1()
        for name, data in sorted(self.repos[repo].items()):
            digest.update(name.encode() + hashlib.sha1(data).digest())
        return digest.hexdigest()

    def gets(self, suffix: str) -> int:
        """GET requests for files whose path ends with `suffix` (downloads, not HEADs)."""
        return sum(1 for m, p, _ in self.log if m == "GET" and "/resolve/" in p and p.endswith(suffix))

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # quiet: the test reads hub.log instead
            pass

        def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None, *,
                  head: bool = False) -> None:
            self.send_response(status)
            for k, v in {"Content-Length": str(len(body)), **(headers or {})}.items():
                self.send_header(k, v)
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _json(self, value: object, status: int = 200) -> None:
            self._send(status, json.dumps(value).encode(), {"Content-Type": "application/json"})

        def _missing(self, head: bool = False) -> None:
            self._send(404, b"", {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"},
                       head=head)

        def _route(self, head: bool = False) -> None:
            path = unquote(urlparse(self.path).path)
            hub.log.append((self.command, path, self.headers.get("Authorization")))
            parts = path.strip("/").split("/")
            if parts[:2] in (["api", "models"], ["api", "datasets"]) and len(parts) >= 6 and \
                    parts[4] in ("revision", "tree"):
                repo = "/".join(parts[2:4]) if parts[1] == "models" else "/".join(parts[1:4])
                if repo not in hub.repos:
                    return self._missing()
                files = hub.repos[repo]
                if parts[4] == "revision":
                    return self._json({"id": repo, "sha": hub.commit(repo), "private": False,
                                       "siblings": [{"rfilename": n} for n in files]})
                return self._json([{"type": "file", "path": n, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                                   for n, d in files.items()])
            if parts[0] == "datasets" and len(parts) >= 6 and parts[3] == "resolve":
                parts = ["/".join(parts[:2]), *parts[2:]]  # "datasets/OWNER" as the owner: the same layout below
            if len(parts) >= 5 and parts[2] == "resolve":
                repo, name = "/".join(parts[:2]), "/".join(parts[4:])
                if repo not in hub.repos:
                    return self._missing(head)
                if name not in hub.repos[repo]:
                    return self._send(404, b"", {"X-Error-Code": "EntryNotFound"}, head=head)
                data = hub.repos[repo][name]
                return self._send(200, data, {"X-Repo-Commit": hub.commit(repo),
                                              "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                                              "Content-Type": "application/octet-stream"}, head=head)
            return self._send(404, b"", head=head)

        def do_HEAD(self) -> None:  # noqa: N802 (http.server's names)
            self._route(head=True)

        def do_GET(self) -> None:  # noqa: N802
            self._route()

        def do_POST(self) -> None:  # noqa: N802
            path = unquote(urlparse(self.path).path)
            hub.log.append(("POST", path, self.headers.get("Authorization")))
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            parts = path.strip("/").split("/")
            if parts == ["api", "repos", "create"]:
                payload = json.loads(body)
                repo = f"{payload['organization']}/{payload['name']}"
                hub.repos.setdefault(repo, {})
                return self._json({"url": f"{hub.endpoint}/{repo}"})
            repo = "/".join(parts[2:4])
            if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "preupload":
                files = json.loads(body)["files"]
                return self._json({"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                             for f in files]})
            if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "commit":
                for line in body.splitlines():
                    item = json.loads(line)
                    if item["key"] == "file":
                        hub.repos[repo][item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                sha = hub.commit(repo)
                return self._json({"commitOid": sha, "commitUrl": f"{hub.endpoint}/{repo}/commit/{sha}"})
            return self._send(404)

    return Handler
