"""The devcluster's Services on loopback: what kube-proxy does on a real cluster, for the pods the executor runs.

Each port of a Service with a selector gets a listener on 127.0.0.1, announced on the Service as
`devcluster.tailor.dev/ports: {"http": 31240, ...}` (by port name, or number where it has none) and kept across
executor restarts while that port is free. Each connection goes to the next of the Service's ready pods, in turn,
at the loopback port the executor gave the pod's target port. A pod that is not ready, or is being deleted, gets no
new connections; the ones it has stay until they close or it stops. The log says how many a pod had open as it left
a Service and when the last of them ended: how a drain is checked. With no ready pod a new connection is closed at
once, as kube-proxy rejects it. Pods on the simulated (kwok) nodes run nowhere and are never a backend.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tailor.devcluster.log import log

LOOPBACK = "127.0.0.1"
CONNECT_TIMEOUT_S = 5.0
CHUNK = 65536


@dataclass(frozen=True)
class LocalEndpoint:
    """A pod the executor runs, as a Service sees it."""

    namespace: str
    name: str
    labels: Mapping[str, str]
    ready: bool
    ports: Mapping[str, int]  # container port name and number -> its loopback port


class Listener:
    """One Service port on loopback: accepts connections and relays each to the next backend."""

    def __init__(self, what: str, port: int = 0) -> None:
        self.what = what
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.socket.bind((LOOPBACK, port))
        except OSError:  # the announced port is taken now: a new one
            self.socket.bind((LOOPBACK, 0))
        self.socket.listen(256)
        self.port: int = self.socket.getsockname()[1]
        self.backends: dict[int, str] = {}  # loopback port -> the pod behind it, in turn
        self.open: Counter[int] = Counter()  # connections relayed to each backend port, not yet ended
        self.leaving: dict[int, str] = {}  # ports of pods out of the Service with connections still open
        self.closed = False
        self._turn = itertools.count()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name=f"service {what}", daemon=True).start()

    def set_backends(self, backends: dict[int, str]) -> None:
        """The Service's ready pods now, by loopback port."""
        with self._lock:
            if backends != self.backends:
                log(f"service {self.what}: {len(backends)} ready endpoint(s)")
            for port, pod in self.backends.items():
                if port not in backends:
                    log(f"service {self.what}: pod {pod} left with {self.open[port]} connection(s) open")
                    if self.open[port]:
                        self.leaving[port] = pod
            self.backends = dict(backends)

    def _next(self) -> int | None:
        with self._lock:
            if not self.backends:
                return None
            port = list(self.backends)[next(self._turn) % len(self.backends)]
            self.open[port] += 1
            return port

    def _relay(self, client: socket.socket, port: int) -> None:
        try:
            _relay(client, port)
        finally:
            with self._lock:
                self.open[port] -= 1
                if not self.open[port] and port in self.leaving:
                    log(f"service {self.what}: the last connection to pod {self.leaving.pop(port)} ended")

    def _accept(self) -> None:
        while not self.closed:
            try:
                connection, _ = self.socket.accept()
            except OSError as error:
                if not self.closed:  # out of descriptors, say: the port must keep listening
                    log(f"service {self.what}: accept failed: {error}")
                    time.sleep(0.1)
                continue
            backend = self._next()
            if backend is None:
                connection.close()
                continue
            try:
                threading.Thread(target=self._relay, args=(connection, backend), daemon=True).start()
            except RuntimeError as error:  # no thread to spare: this connection is refused, not the port
                log(f"service {self.what}: {error}")
                with self._lock:
                    self.open[backend] -= 1
                connection.close()

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.socket.shutdown(socket.SHUT_RDWR)
        self.socket.close()


def _relay(client: socket.socket, port: int) -> None:
    try:
        upstream = socket.create_connection((LOOPBACK, port), timeout=CONNECT_TIMEOUT_S)
    except OSError:
        client.close()
        return
    upstream.settimeout(None)
    back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
    back.start()
    _pump(client, upstream)
    back.join()
    client.close()
    upstream.close()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    """Copy `source` to `sink` until `source` ends, then end `sink`'s writing half (a half-close passes on)."""
    try:
        while data := source.recv(CHUNK):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


def _selects(selector: Mapping[str, str] | None, labels: Mapping[str, str]) -> bool:
    return bool(selector) and all(labels.get(key) == value for key, value in (selector or {}).items())


class ServiceProxy:
    """The listeners of every Service port, kept in step with the Services and the executor's pods."""

    def __init__(self) -> None:
        self.listeners: dict[tuple[str, str, str], Listener] = {}

    def sync(self, services: list[Any], endpoints: list[LocalEndpoint],
             announced: Mapping[tuple[str, str], Mapping[str, int]]) -> dict[tuple[str, str], dict[str, int]]:
        """Open, update and close listeners for `services` (V1Service objects); returns each Service's ports to
        announce, by (namespace, name). `announced` holds the ports announced before, to keep them."""
        wanted: dict[tuple[str, str], dict[str, int]] = {}
        kept = set()
        for service in services:
            meta, spec = service.metadata, service.spec
            if not spec.selector or spec.type == "ExternalName":
                continue
            backends = [e for e in endpoints if e.namespace == meta.namespace and e.ready
                        and _selects(spec.selector, e.labels)]
            for port in spec.ports or []:
                port_name = port.name or str(port.port)
                key = (meta.namespace, meta.name, port_name)
                listener = self.listeners.get(key)
                if listener is None:
                    before = announced.get((meta.namespace, meta.name), {}).get(port_name, 0)
                    listener = self.listeners[key] = Listener(f"{meta.namespace}/{meta.name}:{port_name}", before)
                target = str(port.target_port if port.target_port is not None else port.port)
                listener.set_backends({e.ports[target]: e.name for e in backends if target in e.ports})
                wanted.setdefault((meta.namespace, meta.name), {})[port_name] = listener.port
                kept.add(key)
        for key in set(self.listeners) - kept:
            self.listeners.pop(key).close()
        return wanted

    def close(self) -> None:
        for listener in self.listeners.values():
            listener.close()
        self.listeners.clear()
