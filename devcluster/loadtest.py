"""A load test of a model served on the devcluster, through its Service, while its HorizontalPodAutoscaler works:
what `bench/autoscaling.py` plots and `tests/cluster/test_demo.py` checks.

Clients send generation requests (Triton's HTTP generate_stream, a new connection each, so the Service's loopback
port spreads them over the ready replicas) in phases, each until something happens on the cluster, once the pool
is at its HPA's minimum (an earlier run's extra replica waits out the scale-down window first):

1. **surge**: `surge_clients` clients until the HPA has scaled out, the new replica is Ready and has answered
   requests, then `hold_s` more seconds;
2. **calm**: `calm_clients` clients (fewer than a batch: nothing waits) until the Deployment is back to its HPA's
   minimum and the removed pod is gone (the HPA waits out its scale-down stabilisation window, then the pod is
   drained: it leaves the Service, and the requests it holds finish);
3. **idle**: no client for `idle_s` seconds.

A sampler reads, every `SAMPLE_S`, what a user could: the custom metrics API (the queue metric per pod), the
HPA's status, the Deployment's ready replicas, and Prometheus (requests answered per pod, from vLLM's
`e2e_request_latency` histogram). Every request's start, end and outcome is kept. All figures are measured.
"""

from __future__ import annotations

import http.client
import json
import math
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

import yaml
from kubernetes import client
from kubernetes.utils import parse_quantity
from pydantic import BaseModel

from tailor.devcluster import cluster, demo
from tailor.devcluster.log import log
from tailor.operator import api as model
from tailor.operator.deployment import ENGINE_ARGS_ANNOTATION
from tailor.operator.names import service_name

SAMPLE_S = 2.0
DEMO_POOL = "local"
PROMPTS = ("Once upon a time", "The capital of France is", "To be, or not to be,", "In the beginning",
           "The quick brown fox", "A long time ago", "It was the best of times,", "Call me Ishmael.")


class Request(BaseModel):
    started: float  # seconds since the test began
    seconds: float
    phase: str
    error: str | None = None


class Sample(BaseModel):
    at: float  # seconds since the test began
    phase: str
    clients: int
    metric: dict[str, float]  # pod -> the HPA's metric, from the custom metrics API
    hpa_average: float | None  # what the HPA last read, averaged over the replicas
    desired_replicas: int
    current_replicas: int
    ready_replicas: int
    answered: dict[str, int]  # pod -> requests answered so far (Prometheus)


class Events(BaseModel):
    """Seconds since the test began, when each was first seen (None: never)."""

    scaled_out: float | None = None  # the HPA asked for more replicas
    new_replica_ready: float | None = None
    new_replica_answered: float | None = None
    scaled_in: float | None = None  # the HPA asked for fewer again
    removed_replica_gone: float | None = None
    in_flight_at_scale_in: int | None = None  # the clients' requests running when the HPA scaled in
    removed_pods: list[str] = []


class LoadTest(BaseModel):
    namespace: str
    service: str
    hpa: str
    metric: str
    target: float  # the HPA's target average per replica
    min_replicas: int
    max_replicas: int
    surge_clients: int
    requests: list[Request] = []
    samples: list[Sample] = []
    events: Events = Events()

    def failed(self, phase: str | None = None) -> list[Request]:
        return [r for r in self.requests if r.error is not None and phase in (None, r.phase)]


class Clients:
    """`count` threads, each sending one request after another until told to stop."""

    def __init__(self, send: Callable[[str, str], None], record: Callable[[Request], None], began: float) -> None:
        self.send, self.record, self.began = send, record, began
        self.phase = ""
        self.in_flight = 0
        self.counting = threading.Lock()
        self.stops: list[threading.Event] = []
        self.threads: list[threading.Thread] = []

    def set(self, count: int, phase: str) -> None:
        self.phase = phase
        while len(self.stops) > count:
            self.stops.pop().set()
        while len(self.stops) < count:
            stop = threading.Event()
            self.stops.append(stop)
            thread = threading.Thread(target=self._loop, args=(stop, len(self.stops)), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _loop(self, stop: threading.Event, seed: int) -> None:
        turn = seed
        while not stop.is_set():
            phase, started = self.phase, time.monotonic()
            error = None
            with self.counting:
                self.in_flight += 1
            try:
                self.send(PROMPTS[turn % len(PROMPTS)], phase)
            except Exception as failure:  # every failure is a result: it is counted, not raised
                error = f"{type(failure).__name__}: {failure}"[:300]
            finally:
                with self.counting:
                    self.in_flight -= 1
            self.record(Request(started=started - self.began, seconds=time.monotonic() - started, phase=phase,
                                error=error))
            turn += 1

    def stop(self) -> None:
        self.set(0, self.phase)
        for thread in self.threads:
            thread.join(timeout=600)


def run(api: client.ApiClient, namespace: str, service: str, hpa: str, send: Callable[[str, str], None],
        prometheus: str, surge_clients: int = 8, hold_s: float = 30, calm_clients: int = 4, idle_s: float = 10,
        timeout_s: float = 900) -> LoadTest:
    """The three phases against `service` (its revision's HPA `hpa`); `send` makes one request with a prompt, in a
    phase. Raises when a phase's event does not come within `timeout_s`, with what was sampled so far."""
    autoscaling: Any = client.AutoscalingV2Api(api)
    apps: Any = client.AppsV1Api(api)
    spec = autoscaling.read_namespaced_horizontal_pod_autoscaler(hpa, namespace).spec
    first = spec.metrics[0].pods
    result = LoadTest(namespace=namespace, service=service, hpa=hpa, metric=first.metric.name,
                      target=_quantity(first.target.average_value),
                      min_replicas=spec.min_replicas, max_replicas=spec.max_replicas, surge_clients=surge_clients)
    deployment = spec.scale_target_ref.name
    settle = time.monotonic() + timeout_s
    while len(found := _pods(api, namespace, deployment)) > spec.min_replicas:
        if time.monotonic() > settle:
            raise TimeoutError(f"{deployment} still has {len(found)} pods after {timeout_s:.0f}s")
        log(f"waiting for {deployment} to be back at {spec.min_replicas} replica(s): {len(found)} pods")
        time.sleep(10)
    began = time.monotonic()
    lock = threading.Lock()

    def record(request: Request) -> None:
        with lock:
            result.requests.append(request)

    clients = Clients(send, record, began)
    pods_at_start = set(_pods(api, namespace, deployment))

    def sample() -> Sample:
        hpa_now = autoscaling.read_namespaced_horizontal_pod_autoscaler(hpa, namespace)
        average = next((_quantity(m.pods.current.average_value) for m in hpa_now.status.current_metrics
                        or [] if m.pods is not None and m.pods.metric.name == result.metric), None)
        ready = apps.read_namespaced_deployment(deployment, namespace).status.ready_replicas or 0
        found = Sample(at=time.monotonic() - began, phase=clients.phase, clients=len(clients.stops),
                       metric=_custom_metric(api, namespace, result.metric), hpa_average=average,
                       desired_replicas=hpa_now.status.desired_replicas or 0,
                       current_replicas=hpa_now.status.current_replicas or 0, ready_replicas=ready,
                       answered=_answered(prometheus, namespace))
        result.samples.append(found)
        return found

    def until(phase: str, what: str, done: Callable[[Sample], bool]) -> None:
        deadline = time.monotonic() + timeout_s
        while not done(now := sample()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{phase}: no {what} after {timeout_s:.0f}s; last sample {now.model_dump()}")
            time.sleep(SAMPLE_S)

    events = result.events
    start_replicas = len(pods_at_start)
    try:
        log(f"load test on Service {namespace}/{service}: {surge_clients} clients until HPA {hpa} scales out")
        clients.set(surge_clients, "surge")

        def grown(now: Sample) -> bool:
            if events.scaled_out is None and now.desired_replicas > start_replicas:
                events.scaled_out = now.at
                log(f"HPA {hpa}: {start_replicas} -> {now.desired_replicas} replicas at {now.at:.0f}s "
                    f"({result.metric} {now.hpa_average} per replica, target {result.target})")
            if events.new_replica_ready is None and now.ready_replicas > start_replicas:
                events.new_replica_ready = now.at
                log(f"a new replica is Ready at {now.at:.0f}s")
            new = [pod for pod, count in now.answered.items() if pod not in pods_at_start and count > 0]
            if events.new_replica_answered is None and new and events.new_replica_ready is not None:
                events.new_replica_answered = now.at
                log(f"{new[0]} answers requests at {now.at:.0f}s")
            return events.new_replica_answered is not None

        until("surge", "second replica answering", grown)
        hold_until = time.monotonic() + hold_s
        until("surge", "end of the hold", lambda _: time.monotonic() > hold_until)

        log(f"load test: {calm_clients} clients until HPA {hpa} scales back to {spec.min_replicas}")
        clients.set(calm_clients, "calm")
        scaled = set(_pods(api, namespace, deployment))

        def shrunk(now: Sample) -> bool:
            if events.scaled_in is None and now.desired_replicas < max(s.desired_replicas for s in result.samples):
                events.scaled_in, events.in_flight_at_scale_in = now.at, clients.in_flight
                log(f"HPA {hpa}: down to {now.desired_replicas} replica(s) at {now.at:.0f}s, {clients.in_flight} "
                    "request(s) in flight")
            left = set(_pods(api, namespace, deployment))
            if events.scaled_in is not None and len(left) <= spec.min_replicas:
                events.removed_replica_gone, events.removed_pods = now.at, sorted(scaled - left)
                log(f"the removed replica ({', '.join(events.removed_pods)}) is gone at {now.at:.0f}s")
            return events.removed_replica_gone is not None

        until("calm", "scale-down to minReplicas", shrunk)
        clients.set(0, "idle")
        idle_until = time.monotonic() + idle_s
        until("idle", "end of the idle tail", lambda _: time.monotonic() > idle_until)
    finally:  # whatever happens, no client goes on sending
        clients.stop()
    log(f"load test: {len(result.requests)} requests, {len(result.failed())} failed")
    return result


def demo_model(api: client.ApiClient) -> dict[str, Any] | None:
    """The demo's model (`tailor demo`), once Ready."""
    name = yaml.safe_load(demo.EXAMPLE.read_text())["metadata"]["name"]
    try:
        body: Any = client.CustomObjectsApi(api).get_namespaced_custom_object(
            model.GROUP, model.API_VERSION, demo.NAMESPACE, model.PLURAL, name)
    except client.exceptions.ApiException:
        return None
    return dict(body) if (body.get("status") or {}).get("phase") == "Ready" else None


def on_demo_model(api: client.ApiClient, body: dict[str, Any], hold_s: float, max_tokens: int,
                  clients: int | None = None, calm_clients: int = 4, calm_tokens: int = 256) -> LoadTest:
    """The load test against the demo model's local pool: each request generates exactly `max_tokens`, or
    `calm_tokens` while the HPA scales in (longer requests, so that the replica removed holds some). Requests
    wait only once a replica's batch is full, so the surge has, unless `clients` says otherwise, max_num_seqs
    (from the revision's engine arguments) plus twice the HPA's target clients: the queue passes the target."""
    name = body["metadata"]["name"]
    revision = next(p for p in body["status"]["pools"] if p["name"] == DEMO_POOL)["revision"]
    service = service_name(name, DEMO_POOL)
    hpa = f"{service}-{revision}"
    http = demo.service_ports(api, demo.NAMESPACE, service)["http"]
    if clients is None:
        found: Any = client.AppsV1Api(api).read_namespaced_deployment(hpa, demo.NAMESPACE)
        batch = json.loads(found.metadata.annotations[ENGINE_ARGS_ANNOTATION])["max_num_seqs"]
        target: Any = client.AutoscalingV2Api(api).read_namespaced_horizontal_pod_autoscaler(hpa, demo.NAMESPACE)
        clients = batch + 2 * math.ceil(_quantity(target.spec.metrics[0].pods.target.average_value))

    def send(prompt: str, phase: str) -> None:
        tokens = calm_tokens if phase == "calm" else max_tokens
        generate_stream(f"http://127.0.0.1:{http}", name, prompt, {
            "max_tokens": tokens, "min_tokens": tokens, "temperature": 0})

    prometheus = f"http://127.0.0.1:{cluster.Ports().prometheus}"
    return run(api, demo.NAMESPACE, service, hpa, send, prometheus, surge_clients=clients, hold_s=hold_s,
               calm_clients=calm_clients)


def generate_stream(url: str, model_name: str, prompt: str, sampling: dict[str, Any], timeout_s: float = 300
                    ) -> str:
    """One request to Triton's generate_stream endpoint (server-sent events), on a connection of its own: the
    text. An HTTP/1.1 client like this one is spread over the replicas request by request; a gRPC client keeps
    one HTTP/2 connection, so an L4 Service (kube-proxy, or the devcluster's) pins it to one replica."""
    body = json.dumps({"text_input": prompt, "stream": True, "sampling_parameters": json.dumps(sampling),
                       "exclude_input_in_output": True})
    address = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(address.hostname or "127.0.0.1", address.port, timeout=timeout_s)
    pieces = []
    try:  # closed whatever happens: a connection the server closed unanswered must not wait for the collector
        connection.request("POST", f"/v2/models/{model_name}/generate_stream", body=body,
                           headers={"Content-Type": "application/json", "Connection": "close"})
        reply = connection.getresponse()
        if reply.status != 200:
            raise RuntimeError(f"{model_name}: HTTP {reply.status}: {reply.read()[:300]!r}")
        for line in reply:
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[len(b"data: "):])
            if "error" in event:
                raise RuntimeError(f"{model_name}: {event['error']}")
            pieces.append(event.get("text_output", ""))
    finally:
        connection.close()
    if not pieces:
        raise RuntimeError(f"{model_name}: the stream ended without text")
    return "".join(pieces)


def _quantity(value: str) -> float:
    """A Kubernetes quantity (`1500m`, `2`) as a number."""
    return float(parse_quantity(value))  # type: ignore[no-untyped-call]


def _pods(api: client.ApiClient, namespace: str, deployment: str) -> list[str]:
    """The Deployment's pods, any that is terminating included."""
    found: Any = client.AppsV1Api(api).read_namespaced_deployment(deployment, namespace)
    selector = ",".join(f"{k}={v}" for k, v in found.spec.selector.match_labels.items())
    core: Any = client.CoreV1Api(api)
    return [p.metadata.name for p in core.list_namespaced_pod(namespace, label_selector=selector).items]


def _custom_metric(api: client.ApiClient, namespace: str, metric: str) -> dict[str, float]:
    """The metric per pod, as the custom metrics API serves it to the HPA (empty while it serves none)."""
    path = f"/apis/custom.metrics.k8s.io/v1beta1/namespaces/{namespace}/pods/*/{metric}"
    method, url, headers, _, _ = api.param_serialize("GET", path, auth_settings=["BearerToken"],
                                                     header_params={"Accept": "application/json"})
    response = api.call_api(method, url, header_params=headers, _request_timeout=10)
    response.read()  # type: ignore[no-untyped-call]
    if response.status != 200:  # the adapter serves no such series yet
        return {}
    raw = json.loads(response.data or b"{}")
    return {item["describedObject"]["name"]: _quantity(item["value"]) for item in raw.get("items", [])}


def _answered(prometheus: str, namespace: str) -> dict[str, int]:
    """Requests each pod has answered, by vLLM's own count (scraped by Prometheus)."""
    query = f'sum by (pod) (vllm:e2e_request_latency_seconds_count{{namespace="{namespace}"}})'
    url = f"{prometheus}/api/v1/query?{urllib.parse.urlencode({'query': query})}"
    with urllib.request.urlopen(url, timeout=10) as reply:
        data = json.loads(reply.read())
    return {entry["metric"]["pod"]: int(float(entry["value"][1])) for entry in data["data"]["result"]}
