"""The part of a kubelet's API the API server calls for `kubectl logs`, served by the devcluster's executor for the
pods it runs: `GET /containerLogs/<namespace>/<pod>/<container>` over HTTPS on loopback, with the query the API
server passes on (`tailLines`, `limitBytes`, `follow`; `timestamps`, `sinceSeconds` and `previous` are not
implemented and ignored). The executor node announces this port as its kubelet endpoint and 127.0.0.1 as its
address; the API server verifies the serving certificate against the devcluster's CA.
"""

from __future__ import annotations

import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tailor.devcluster.log import log

FOLLOW_POLL_S = 0.5
CHUNK = 64 * 1024

# (namespace, pod, container) -> the container's log file and whether it still runs; None for a pod not here
Find = Callable[[str, str, str], "tuple[Path, Callable[[], bool]] | None"]


def tail(data: bytes, lines: int | None, limit: int | None) -> bytes:
    """The last `lines` lines of `data` (all when None), then at most the first `limit` bytes of them, as a
    kubelet applies tailLines and limitBytes."""
    if lines is not None:
        data = b"".join(data.splitlines(keepends=True)[-lines:]) if lines > 0 else b""
    return data if limit is None else data[:limit]


class LogServer:
    """A threaded HTTPS server on 127.0.0.1:`port` (0: a free one) answering container log requests."""

    def __init__(self, find: Find, cert: Path, key: Path, port: int = 0) -> None:
        handler = type("Handler", (_Handler,), {"find": staticmethod(find)})
        self.server = ThreadingHTTPServer(("127.0.0.1", port), handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.server.daemon_threads = True
        self.port: int = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, name="kubelet-logs", daemon=True)
        self.thread.start()
        log(f"executor: container logs served at https://127.0.0.1:{self.port}/containerLogs/")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Handler(BaseHTTPRequestHandler):
    find: Find
    protocol_version = "HTTP/1.1"  # chunked responses: a followed log streams as it grows

    def log_message(self, format: str, *args: object) -> None:
        pass  # the API server's requests are not worth a line each

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        parts = url.path.strip("/").split("/")
        if len(parts) != 4 or parts[0] != "containerLogs":
            self.send_error(404, "only /containerLogs/<namespace>/<pod>/<container> is served")
            return
        found = self.find(*parts[1:])
        if found is None:
            self.send_error(404, f"container {parts[3]} of pod {parts[1]}/{parts[2]} is not on this node")
            return
        path, running = found
        query = urllib.parse.parse_qs(url.query)

        def number(name: str) -> int | None:
            return int(query[name][0]) if query.get(name, [""])[0].isdigit() else None

        data = path.read_bytes() if path.is_file() else b""
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        sent = tail(data, number("tailLines"), number("limitBytes"))
        if sent:
            self._chunk(sent)
        if query.get("follow", [""])[0] == "true":
            offset = len(data)
            while running():  # new output as it is written, until the container ends
                time.sleep(FOLLOW_POLL_S)
                with path.open("rb") as file:
                    file.seek(offset)
                    more = file.read(CHUNK)
                offset += len(more)
                if more and not self._chunk(more):
                    return
        self._chunk(b"")

    def _chunk(self, data: bytes) -> bool:
        """One chunk of the response (an empty one ends it); False once the client has gone."""
        try:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
            return False
        return True
