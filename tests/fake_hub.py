"""A loopback HTTP server that answers as the Hugging Face Hub does for what huggingface_hub's
snapshot_download asks (HF_ENDPOINT points at it): a revision's commit, the file tree, and each
file under /{repo}/resolve/{revision}/{path}. It records every request, so tests see what was
fetched."""
from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


@dataclass
class FakeRepo:
    files_by_revision: dict[str, dict[str, bytes]]  # branch name -> path -> content
    token: str | None = None  # gated: only this bearer token may read it

    def commit(self, revision: str) -> str | None:
        """A branch's commit id, or the revision itself when it is one of those ids."""
        for branch, files in self.files_by_revision.items():
            sha = hashlib.sha1(branch.encode() + json.dumps(sorted(files)).encode()).hexdigest()
            if revision in (branch, sha):
                return sha
        return None

    def files(self, commit: str) -> dict[str, bytes]:
        return next(f for b, f in self.files_by_revision.items() if self.commit(b) == commit)


def repo_from_dir(directory: Path, extra: dict[str, bytes] | None = None) -> dict[str, bytes]:
    """A checkpoint directory's files as a revision's contents."""
    files = {p.name: p.read_bytes() for p in Path(directory).iterdir() if p.is_file()}
    return {**files, **(extra or {})}


@dataclass
class FakeHub:
    repos: dict[str, FakeRepo]
    requests: list[tuple[str, str]] = field(default_factory=list)  # (method, path)
    url: str = ""

    def __enter__(self) -> "FakeHub":
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                self._answer(body=False)

            def do_GET(self) -> None:
                self._answer(body=True)

            def _answer(self, body: bool) -> None:
                path = unquote(urlparse(self.path).path)
                hub.requests.append((self.command, path))
                status, headers, payload = hub.route(path, self.headers.get("Authorization"))
                self.send_response(status)
                for key, value in {**headers, "Content-Length": str(len(payload))}.items():
                    self.send_header(key, value)
                self.end_headers()
                if body:
                    self.wfile.write(payload)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def fetched_files(self) -> set[str]:
        return {p.split("/resolve/", 1)[1].split("/", 1)[1] for m, p in self.requests if m == "GET" and "/resolve/" in p}

    def route(self, path: str, authorization: str | None) -> tuple[int, dict, bytes]:
        for prefix in ("/api/models/", "/"):
            if not path.startswith(prefix):
                continue
            parts = path[len(prefix):].split("/")
            repo_id = "/".join(parts[:2])
            repo = self.repos.get(repo_id)
            if repo is None:
                continue
            if repo.token is not None and authorization != f"Bearer {repo.token}":
                return _error(401, "GatedRepo", f"Access to model {repo_id} is restricted.")
            rest = parts[2:]
            if prefix == "/api/models/" and len(rest) == 2 and rest[0] in ("revision", "tree"):
                commit = repo.commit(rest[1])
                if commit is None:
                    return _error(404, "RevisionNotFound", f"Invalid rev id: {rest[1]}")
                files = repo.files(commit)
                if rest[0] == "revision":
                    info = {"id": repo_id, "sha": commit, "siblings": [{"rfilename": f} for f in sorted(files)]}
                    return 200, {"Content-Type": "application/json"}, json.dumps(info).encode()
                tree = [{"type": "file", "path": f, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                        for f, data in sorted(files.items())]
                return 200, {"Content-Type": "application/json"}, json.dumps(tree).encode()
            if prefix == "/" and len(rest) >= 3 and rest[0] == "resolve":
                commit = repo.commit(rest[1])
                if commit is None:
                    return _error(404, "RevisionNotFound", f"Invalid rev id: {rest[1]}")
                data = repo.files(commit).get("/".join(rest[2:]))
                if data is None:
                    return _error(404, "EntryNotFound", f"{path} does not exist")
                return 200, {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha1(data).hexdigest()}"'}, data
        return _error(404, "RepoNotFound", f"Repository not found: {path}")


def _error(status: int, code: str, message: str) -> tuple[int, dict, bytes]:
    return status, {"X-Error-Code": code, "X-Error-Message": message, "Content-Type": "application/json"}, \
        json.dumps({"error": message}).encode()
