"""A loopback server speaking the Hugging Face Hub's HTTP API, as `huggingface_hub`'s
`snapshot_download` uses it (pointed at through `HF_ENDPOINT`), and a hub cache laid
out as `huggingface_hub` lays it out.

The routes: `GET /api/models/{repo}/revision/{revision}` (the commit), `GET
/api/models/{repo}/tree/{commit}` (the files, sizes and git ids), `HEAD` and `GET
/{repo}/resolve/{revision}/{file}` (the commit, ETag and size in headers; `Range`
answered with 206). An unknown repository answers 401 with `X-Error-Code: RepoNotFound`
and an unknown revision 404 with `RevisionNotFound`, as the Hub does.
"""

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


def git_oid(data: bytes) -> str:
    """The git blob id of `data`, as the Hub gives it (the ETag of a non-LFS file)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def commit_of(files: dict[str, bytes]) -> str:
    """A commit hash (40 hex digits) that depends on the files only."""
    h = hashlib.sha1()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + git_oid(files[name]).encode())
    return h.hexdigest()


def repo_files(directory: Path) -> dict[str, bytes]:
    """Every file of `directory` (links followed) by name."""
    return {f.name: f.read_bytes() for f in sorted(Path(directory).iterdir()) if f.is_file()}


def point_hub(monkeypatch, cache: Path, endpoint: str, offline: bool = False) -> None:
    """Points huggingface_hub at the hub cache `cache` and the Hub at `endpoint`, online
    or not, as HF_HUB_CACHE, HF_ENDPOINT and HF_HUB_OFFLINE would (it reads them once, at
    import: its constants are set here instead)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    template = endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)


def lay_out_cache(hub_cache: Path, repo: str, files: dict[str, bytes]) -> Path:
    """Writes `files` as huggingface_hub's cache holds a download of `repo` at `main`:
    `models--org--name/blobs/<etag>`, `snapshots/<commit>/<file>` links to the blobs,
    `refs/main` holding the commit. Returns the snapshot folder."""
    root = Path(hub_cache) / ("models--" + repo.replace("/", "--"))
    commit = commit_of(files)
    snapshot = root / "snapshots" / commit
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    for name, data in files.items():
        blob = root / "blobs" / git_oid(data)
        blob.write_bytes(data)
        (snapshot / name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    return snapshot


class Hub:
    """The loopback Hub, serving `repos` ({repo id: {file name: bytes}}) at revision
    `main`, on a free port of 127.0.0.1 until `close()`.

    Attributes:
        url: its endpoint (`HF_ENDPOINT`).
        requests: (method, path, Range header or None) of every request, in order.
        cut: {file name: bytes}: the next GET of that file sends only that many bytes of
            its body, then closes the connection (once per entry; then in `cut_at`).
        fail: file names whose GETs answer 500.
    """

    def __init__(self, repos: dict[str, dict[str, bytes]]):
        self.repos = repos
        self.requests: list[tuple[str, str, str | None]] = []
        self.cut: dict[str, int] = {}
        self.cut_at: dict[str, int] = {}
        self.fail: set[str] = set()
        self._lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_HEAD(self):
                hub._answer(self, head=True)

            def do_GET(self):
                hub._answer(self, head=False)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def file_requests(self, method: str = "GET") -> list[tuple[str, str | None]]:
        """(file name, Range) of each `method` request of a file, in order."""
        return [
            (p.rsplit("/", 1)[1], r)
            for m, p, r in self.requests
            if m == method and "/resolve/" in p
        ]

    def _answer(self, req: BaseHTTPRequestHandler, head: bool) -> None:
        path = unquote(urlsplit(req.path).path)
        with self._lock:
            self.requests.append((req.command, path, req.headers.get("Range")))
        api = re.fullmatch(r"/api/models/([^/]+/[^/]+)/(revision|tree)/([^/]+)", path)
        resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if api is None and resolve is None:
            return _send(req, 404, b"{}", head=head)
        repo, revision = (api or resolve)[1], (api or resolve)[3 if api else 2]
        if repo not in self.repos:
            return _send(req, 401, b"{}", {"X-Error-Code": "RepoNotFound"}, head)
        files = self.repos[repo]
        commit = commit_of(files)
        if revision not in ("main", commit):
            return _send(req, 404, b"{}", {"X-Error-Code": "RevisionNotFound"}, head)
        if api is not None and api[2] == "revision":
            body = {"id": repo, "sha": commit, "siblings": [{"rfilename": f} for f in files]}
            return _send(req, 200, json.dumps(body).encode(), {}, head)
        if api is not None:
            tree = [
                {"type": "file", "path": f, "size": len(b), "oid": git_oid(b)}
                for f, b in files.items()
            ]
            return _send(req, 200, json.dumps(tree).encode(), {}, head)
        name = resolve[3]
        if name not in files:
            return _send(req, 404, b"{}", {"X-Error-Code": "EntryNotFound"}, head)
        if name in self.fail and not head:
            return _send(req, 500, b"{}")
        data = files[name]
        headers = {"X-Repo-Commit": commit, "ETag": f'"{git_oid(data)}"'}
        start = 0
        if (ranged := re.fullmatch(r"bytes=(\d+)-", req.headers.get("Range") or "")) is not None:
            start = int(ranged[1])
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        body = data[start:]
        with self._lock:
            cut = None if head else self.cut.pop(name, None)
            if cut is not None:
                self.cut_at[name] = cut
        headers["Content-Type"] = "application/octet-stream"
        _send(req, 206 if start else 200, body, headers, head, cut)


def _send(
    req,
    code: int,
    body: bytes,
    headers: dict | None = None,
    head: bool = False,
    cut: int | None = None,
) -> None:
    """Answers `code` with `body` (its whole length announced); with `cut`, only that many
    bytes of it are sent and the connection is closed."""
    headers = {"Content-Type": "application/json", **(headers or {})}
    req.send_response(code)
    for k, v in headers.items():
        req.send_header(k, v)
    req.send_header("Content-Length", str(len(body)))
    req.end_headers()
    if not head:
        req.wfile.write(body if cut is None else body[:cut])
    if cut is not None:
        req.close_connection = True
