"""A local stand-in for the Hugging Face Hub's HTTP API, for testing ``drafttrain push`` with huggingface_hub itself.

It answers the calls create_repo, create_branch and upload_folder make: every file is offered in "regular" mode at
preupload, so the commit carries the files' bytes (base64 in the NDJSON commit payload), which the server keeps
per repo and revision. It records each request (method, path, whether it carried the expected token).
"""

from __future__ import annotations

import base64
import gzip
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeHub:
    def __init__(self, token: str):
        self.token = token
        self.requests: list[tuple[str, str, bool]] = []
        self.repos: dict[str, dict] = {}  # repo -> {"private": bool, "revisions": {rev: {path: bytes}}}
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _body(self) -> bytes:
                data = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                return gzip.decompress(data) if self.headers.get("Content-Encoding") == "gzip" else data

            def _send(self, status: int, payload) -> None:
                body = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                authorised = self.headers.get("Authorization") == f"Bearer {hub.token}"
                hub.requests.append(("POST", self.path, authorised))
                body = self._body()
                if not authorised:
                    return self._send(401, {"error": "Invalid credentials in Authorization header"})
                parts = self.path.split("?")[0].strip("/").split("/")
                if parts[:2] == ["api", "repos"] and parts[2] == "create":
                    request = json.loads(body)
                    repo = f"{request['organization']}/{request['name']}" if request.get("organization") \
                        else request["name"]
                    private = bool(request.get("private")) or request.get("visibility") == "private"
                    hub.repos.setdefault(repo, {"private": private, "revisions": {"main": {}}})
                    return self._send(200, {"url": f"{hub.endpoint}/{repo}", "name": repo})
                if parts[:2] == ["api", "validate-yaml"]:  # the card's metadata, as the Hub checks it
                    import yaml

                    content = json.loads(body)["content"]
                    try:
                        yaml.safe_load(content.split("---")[1])
                    except (yaml.YAMLError, IndexError) as err:
                        return self._send(400, {"errors": [{"message": str(err)}]})
                    return self._send(200, {"errors": [], "warnings": []})
                if parts[:2] == ["api", "models"]:
                    repo, action, revision = "/".join(parts[2:4]), parts[4], "/".join(parts[5:])
                    revisions = hub.repos[repo]["revisions"]
                    if action == "branch":
                        revisions.setdefault(revision, dict(revisions["main"]))
                        return self._send(200, {})
                    if action == "preupload":
                        files = json.loads(body)["files"]
                        return self._send(200, {"files": [{"path": f["path"], "uploadMode": "regular",
                                                           "shouldIgnore": False} for f in files]})
                    if action == "commit":
                        for line in body.decode().splitlines():
                            item = json.loads(line)
                            if item["key"] == "file":
                                value = item["value"]
                                revisions[revision][value["path"]] = base64.b64decode(value["content"])
                        return self._send(200, {"commitUrl": f"{hub.endpoint}/{repo}/commit/{'a' * 40}",
                                                "commitOid": "a" * 40, "success": True})
                return self._send(404, {"error": f"the fake hub has no {self.path}"})

            def do_GET(self):
                hub.requests.append(("GET", self.path, self.headers.get("Authorization") == f"Bearer {hub.token}"))
                return self._send(404, {"error": f"the fake hub has no {self.path}"})

        return Handler
