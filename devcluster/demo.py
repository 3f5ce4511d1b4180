"""`tailor demo`: Tailor end to end on this machine, as a platform engineer would meet it.

1. the devcluster (built from Go modules the first time), and the Helm chart installed into it: the operator
   runs as the chart's Deployment on the executor node, under the chart's ServiceAccount and RBAC;
2. SmolLM2-135M (from the package index) staged on a `models` claim, and `examples/smollm2-135m-cpu.yaml`
   applied: the real compression, quantization and evaluation Jobs run on this CPU, their logs streamed here;
3. the two Nemotron-3 references (`examples/nemotron-super-{h100,b200}.yaml`) applied beside it: kwok finishes
   their Jobs on the simulated GPU pools with the published child (`simulated.py`), and the operator sizes
   their Triton deployments for real;
4. a prompt sent to the SmolLM2 child's Triton server, then a summary (`runs/demo/summary.json`) and the
   Puzzle search's Pareto plot (`runs/demo/pareto.png`).
"""

from __future__ import annotations

import datetime
import json
import shutil
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from tailor.devcluster import build, cluster
from tailor.devcluster.executor import PORTS_ANNOTATION, announced_ports
from tailor.devcluster.log import log
from tailor.devcluster.metrics import RELIST_INTERVAL_S, SCRAPE_INTERVAL_S
from tailor.devcluster.simulated import published_results
from tailor.operator import api as model
from tailor.operator.names import folder as artifacts_folder
from tailor.operator.names import service_name

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "tailor"
CHART_VALUES = Path(__file__).resolve().parent / "chart-values.yaml"
EXAMPLE = ROOT / "examples" / "smollm2-135m-cpu.yaml"
REFERENCES = [ROOT / "examples" / "nemotron-super-h100.yaml", ROOT / "examples" / "nemotron-super-b200.yaml"]
RELEASE, SYSTEM, NAMESPACE = "tailor", "tailor-system", "tailor-demo"
PROMPT = "The capital of France is"
PROGRESS_S = 20.0  # the longest the demo stays silent while it waits
# The demo's budgets (`--preset fast`, the default): half the example's token budgets, so that a 2-core CPU
# without BF16 math (float32 throughout) finishes in minutes; the child keeps less of the parent (0.80 of its
# accuracy on 2026-12-07, against 0.83 with the example's own budgets, `--preset example`): its floor is 0.6.
# The quality claims live in the benchmarks (docs/benchmarks), not in the demo.
FAST: dict[str, Any] = {
    "minQualityRetention": 0.6, "distillation": {"blockwiseTokens": 2048, "globalTokens": 2048},
    "planOverrides": {"bldActivationTokens": 1024, "scoringTokens": 256, "evalTokens": 512}}


@dataclass
class Heartbeat:
    """When the demo last printed a line: `due` once PROGRESS_S have passed since."""

    last: float = field(default_factory=time.monotonic)

    def printed(self, lines: int = 1) -> None:
        if lines:
            self.last = time.monotonic()

    def due(self) -> bool:
        if time.monotonic() - self.last < PROGRESS_S:
            return False
        self.last = time.monotonic()
        return True


@dataclass
class Demo:
    out: Path
    preset: str = "fast"
    timeout_s: float = 1800.0
    api: client.ApiClient = field(init=False)
    started: float = field(default_factory=time.monotonic)

    # --- set-up ---------------------------------------------------------------------------------------

    def install(self) -> None:
        """The chart, as a user installs it; the CRD applied first, since Helm never upgrades a chart's CRDs."""
        layout, bin_dir = cluster.up(), build.ensure_binaries()
        self.api = config.new_client_from_config(config_file=str(layout.kubeconfig))  # type: ignore[no-untyped-call]
        cluster.tool("kubectl", bin_dir, layout, "apply", "--server-side", "--force-conflicts", "-f",
                     str(CHART / "crds"))
        core: Any = client.CoreV1Api(self.api)
        for namespace in (SYSTEM, NAMESPACE):
            self._ensure(lambda ns=namespace: core.create_namespace({"metadata": {"name": ns}}))
        log(f"installing the chart {CHART.relative_to(ROOT)} as release {RELEASE} in {SYSTEM}, watching {NAMESPACE}")
        cluster.tool("helm", bin_dir, layout, "upgrade", "--install", RELEASE, str(CHART), "-n", SYSTEM, "-f",
                     str(CHART_VALUES), "--set", f"watchNamespaces={{{NAMESPACE}}}", "--wait", "--timeout", "180s")
        cluster.tool("helm", bin_dir, layout, "test", RELEASE, "-n", SYSTEM, "--timeout", "120s")  # raises on failure
        log("helm test: passed (the CRD is served, the operator is available)")

    @staticmethod
    def _ensure(create: Any) -> None:
        try:
            create()
        except ApiException as error:
            if error.status != 409:
                raise

    def stage_parent(self) -> None:
        """SmolLM2-135M on a `models` claim, as a platform team stages weights (here: the claim's folder)."""
        from tailor.compressor.sources import fetch_parent

        parent = fetch_parent()
        core: Any = client.CoreV1Api(self.api)
        self._ensure(lambda: core.create_namespaced_persistent_volume_claim(NAMESPACE, {
            "metadata": {"name": "models", "labels": {"tailor.dev/allowed": "true"},  # given to every model here
                         "annotations": {"tailor.dev/shared-with": "*"}},
            "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "2Gi"}}}}))
        folder = self.claim_folder("models", timeout_s=60) / parent.name
        if not (folder / "config.json").exists():
            shutil.copytree(parent, folder.with_name(f".{folder.name}.partial"), dirs_exist_ok=True)
            folder.with_name(f".{folder.name}.partial").rename(folder)
        log(f"staged {parent.name} on claim {NAMESPACE}/models")

    def claim_folder(self, claim: str, timeout_s: float = 30) -> Path:
        """The folder behind a claim (the devcluster provisions hostPath volumes on this machine)."""
        core: Any = client.CoreV1Api(self.api)
        deadline = time.monotonic() + timeout_s
        while not (volume := core.read_namespaced_persistent_volume_claim(claim, NAMESPACE).spec.volume_name):
            if time.monotonic() > deadline:
                raise RuntimeError(f"claim {NAMESPACE}/{claim} is not bound after {timeout_s:.0f}s")
            time.sleep(1)
        return Path(core.read_persistent_volume(volume).spec.host_path.path)

    # --- the CompressedModels -----------------------------------------------------------------------

    def objects(self) -> list[dict[str, Any]]:
        """The SmolLM2 example (with the preset), and the Nemotron references whose Jobs kwok finishes."""
        example: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
        if self.preset == "fast":
            compression = example["spec"]["compression"]
            compression.update(minQualityRetention=FAST["minQualityRetention"], distillation=FAST["distillation"],
                               planOverrides={**compression["planOverrides"], **FAST["planOverrides"]})
        found = [example]
        for path in REFERENCES:
            reference = yaml.safe_load(path.read_text())
            reference["metadata"]["namespace"] = NAMESPACE
            reference["spec"].setdefault("jobs", {})["podAnnotations"] = published_results()
            found.append(reference)
        return found

    def apply(self) -> list[str]:
        custom = client.CustomObjectsApi(self.api)
        names = []
        for body in self.objects():
            name = body["metadata"]["name"]
            names.append(name)
            self.delete(name)  # a demo starts from scratch
            custom.create_namespaced_custom_object(model.GROUP, model.API_VERSION, NAMESPACE, model.PLURAL, body)
            log(f"applied CompressedModel {NAMESPACE}/{name} (target {body['spec']['compression']['targetGPU']})")
        return names

    def delete(self, name: str) -> None:
        """Delete an earlier demo's CompressedModel, then the artifacts claim it kept: a demo starts from scratch."""
        custom = client.CustomObjectsApi(self.api)
        core: Any = client.CoreV1Api(self.api)
        claim = f"{name}-artifacts"
        for remove, read, what in (
                (lambda: custom.delete_namespaced_custom_object(model.GROUP, model.API_VERSION, NAMESPACE, model.PLURAL,
                                                                name),
                 lambda: self.get(name), f"CompressedModel {name}"),
                (lambda: core.delete_namespaced_persistent_volume_claim(claim, NAMESPACE),
                 lambda: _found(lambda: core.read_namespaced_persistent_volume_claim(claim, NAMESPACE)),
                 f"PersistentVolumeClaim {claim}")):
            try:
                remove()
            except ApiException as error:
                if error.status != 404:
                    raise
                continue
            deadline = time.monotonic() + 120
            while read() is not None:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{what} from an earlier demo was not deleted in 120s")
                time.sleep(1)
            log(f"deleted {what} from an earlier run")

    def get(self, name: str) -> dict[str, Any] | None:
        try:
            found: Any = client.CustomObjectsApi(self.api).get_namespaced_custom_object(
                model.GROUP, model.API_VERSION, NAMESPACE, model.PLURAL, name)
            return dict(found)
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def follow(self, names: list[str]) -> dict[str, dict[str, Any]]:
        """Log phase changes of every object and stream the real Jobs' logs, until all are Ready."""
        said: dict[str, str] = {}
        offsets: dict[Path, int] = {}
        beat = Heartbeat()
        deadline = time.monotonic() + self.timeout_s
        while True:
            bodies = {name: self.get(name) or {} for name in names}
            due = beat.due()  # a line for each object not yet Ready, changed or not
            for name, body in bodies.items():
                status = body.get("status") or {}
                stage: dict[str, Any] = next((s for s in reversed(status.get("stages") or [])
                                              if s.get("state") == "Running"), {})
                what = stage.get("jobName") or stage.get("name")  # Deploy runs several Jobs and revisions
                line = f"{status.get('phase', 'Pending')}" + (f" ({what}: {stage.get('message', '')})" if stage else "")
                if said.get(name) != line or (due and status.get("phase") != "Ready"):
                    log(f"{name}: {line}")
                    said[name] = line
                    beat.printed()
                if status.get("phase") == "Failed":
                    failed: dict[str, Any] = next((c for c in status.get("conditions", []) if c["type"] == "Failed"),
                                                  {})
                    reason, message = failed.get("reason", ""), failed.get("message", "")
                    raise RuntimeError(f"{name} failed: {reason}: {message}\n(kubectl describe cmodel -n {NAMESPACE} "
                                       f"{name})")
            beat.printed(self.stream_logs(offsets))
            if all((b.get("status") or {}).get("phase") == "Ready" for b in bodies.values()):
                return bodies
            if time.monotonic() > deadline:
                raise RuntimeError(f"not Ready after {self.timeout_s:.0f}s: {said}")
            time.sleep(2)

    def stream_logs(self, offsets: dict[Path, int]) -> int:
        """New lines of the namespace's pod logs on the executor node (a kubelet would serve `kubectl logs`);
        returns how many it printed."""
        pods = cluster.Layout(cluster.state_dir()).root / "executor" / "pods"
        found: list[Any] = client.CoreV1Api(self.api).list_namespaced_pod(NAMESPACE).items
        printed = 0
        for pod in found:
            meta = pod.metadata
            for output in sorted((pods / f"{NAMESPACE}_{meta.name}_{meta.uid[:8]}").glob("*/output.log")):
                with output.open("rb") as stream:
                    stream.seek(offsets.get(output, 0))
                    text = stream.read()
                    offsets[output] = stream.tell()
                for line in text.decode(errors="replace").splitlines():
                    if line.strip():
                        print(f"  {output.parent.name:>9} | {line.rstrip()[-150:]}", flush=True)
                        printed += 1
        return printed

    # --- the answer and the summary -----------------------------------------------------------------

    def ask(self, body: dict[str, Any], pool: str) -> dict[str, Any]:
        """The pool's Triton answers PROMPT through its engine; with vLLM, the engine's own count of the
        concurrent requests its KV cache holds is read from the pod's metrics beside the sizing's."""
        from tailor.compressor.serving.client import generate, infer
        from tailor.compressor.sizing.engines import Engine, max_num_seqs

        name = body["metadata"]["name"]
        status = next(p for p in body["status"]["pools"] if p["name"] == pool)
        ports = service_ports(self.api, NAMESPACE, service_name(name, pool))
        started = time.monotonic()
        result: dict[str, Any] = {"engine": status.get("engine"), "notes": status.get("notes", [])}
        if status.get("engine") == Engine.VLLM:
            done = generate(f"127.0.0.1:{ports['grpc']}", name, PROMPT, {"max_tokens": 24, "temperature": 0})
            text, tokens = done.text, done.output_tokens
            result["predicted_concurrency"] = max_num_seqs(status["concurrencyPerReplica"])
            result["engine_concurrency"] = engine_metric(ports["metrics"], "tailor_engine_max_concurrency", name)
            result["openai"] = chat(ports["openai"], name, PROMPT)
        else:
            answer = infer(f"127.0.0.1:{ports['http']}", name, "http", PROMPT, max_tokens=24)
            text, tokens = answer.text, len(answer.ids)
        seconds = time.monotonic() - started
        log(f"Triton (Service {service_name(name, pool)}, engine {status.get('engine')}) answered in "
            f"{seconds:.1f}s:\n\n{PROMPT}{text}\n")
        return {"prompt": PROMPT, "answer": text, "tokens": tokens, "seconds": round(seconds, 2), **result}

    def autoscaling(self, body: dict[str, Any], pool: str, timeout_s: float = 180) -> dict[str, Any]:
        """The pool's HorizontalPodAutoscaler once it reads every metric (Prometheus scrapes Triton, the adapter
        serves the series, the HPA controller syncs): `kubectl get hpa` as a user would see it."""
        name = body["metadata"]["name"]
        revision = next(p for p in body["status"]["pools"] if p["name"] == pool)["revision"]
        hpa_name = f"{service_name(name, pool)}-{revision}"
        autoscaling: Any = client.AutoscalingV2Api(self.api)
        deadline = time.monotonic() + timeout_s
        log(f"waiting for HPA {hpa_name} to read its metrics (scrape every {SCRAPE_INTERVAL_S}s, adapter relist "
            f"every {RELIST_INTERVAL_S}s, HPA sync every 15s)")
        beat = Heartbeat()
        while True:
            hpa = autoscaling.read_namespaced_horizontal_pod_autoscaler(hpa_name, NAMESPACE)
            current = {m.pods.metric.name: m.pods.current.average_value
                       for m in hpa.status.current_metrics or [] if m.pods is not None}
            wanted = {m.pods.metric.name: m.pods.target.average_value for m in hpa.spec.metrics}
            if set(current) == set(wanted):
                break
            if beat.due():
                log(f"HPA {hpa_name} reads {current or 'no metric yet'}; waiting for "
                    f"{sorted(set(wanted) - set(current))}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"HPA {hpa_name} reads {current or 'no metric'} after {timeout_s:.0f}s, wants "
                                   f"{sorted(wanted)} (kubectl describe hpa -n {NAMESPACE} {hpa_name})")
            time.sleep(3)
        return {"name": hpa_name, "metrics": [{"name": metric, "current": current[metric], "target": target}
                                              for metric, target in wanted.items()],
                "replicas": hpa.status.current_replicas, "minReplicas": hpa.spec.min_replicas,
                "maxReplicas": hpa.spec.max_replicas}

    def served_speedup(self, name: str) -> dict[str, Any]:
        """The object's status.servedSpeedup once its speed Job has ended (the child's tokens/s over the parent's
        through Triton + vLLM, measured by the operator's Job on the pool's node: here, this machine), streaming
        the Job's log meanwhile."""
        offsets: dict[Path, int] = {}
        beat = Heartbeat()
        deadline = time.monotonic() + self.timeout_s
        while True:
            found = ((self.get(name) or {}).get("status") or {}).get("servedSpeedup") or {}
            beat.printed(self.stream_logs(offsets))
            if beat.due():
                log(f"{name}: served speed-up {found.get('state') or 'not started'}: "
                    f"{found.get('message') or 'waiting for the speed Job'}")
            if found.get("state") not in (None, "Running"):
                log(f"{name}: served speed-up {found['state']}: {found.get('message')}")
                return found
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: the served speed-up was not measured after {self.timeout_s:.0f}s: {found}")
            time.sleep(2)

    def artifacts(self, body: dict[str, Any]) -> dict[str, Any]:
        """The compression report and quantization report the Jobs left on the artifacts claim."""
        name = body["metadata"]["name"]
        build_dir = self.claim_folder(f"{name}-artifacts") / artifacts_folder(body) / "g1"
        report = json.loads((build_dir / "compress" / "report.json").read_text())
        quantized = json.loads((build_dir / "quantized" / "quantization.json").read_text())
        self.out.mkdir(parents=True, exist_ok=True)
        pareto = next(iter(sorted((build_dir / "compress").rglob("pareto.png"))), None)
        if pareto is not None:
            shutil.copyfile(pareto, self.out / "pareto.png")
        return {"compression": report, "quantization": quantized}


def _found(read: Any) -> Any:
    """What `read()` returns, or None where the API says 404."""
    try:
        return read()
    except ApiException as error:
        if error.status == 404:
            return None
        raise


def engine_metric(port: int, name: str, model: str) -> float | None:
    """A gauge from a pod's metrics port, for `model`."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(f"{name}{{") and f'model="{model}"' in line:
                return float(line.rsplit(" ", 1)[1])
    return None


def _seconds(stage: dict[str, Any]) -> float | None:
    if not stage.get("startedAt") or not stage.get("completedAt"):
        return None
    start, end = (datetime.datetime.fromisoformat(stage[key].replace("Z", "+00:00"))
                  for key in ("startedAt", "completedAt"))
    return (end - start).total_seconds()


def service_ports(api: client.ApiClient, namespace: str, name: str) -> dict[str, int]:
    """The loopback ports the devcluster gives a Service (what its ClusterIP is on a real cluster)."""
    ports = announced_ports(client.CoreV1Api(api).read_namespaced_service(name, namespace))
    if not ports:
        raise RuntimeError(f"Service {namespace}/{name} has no loopback port yet ({PORTS_ANNOTATION})")
    return ports


def chat(port: int, model: str, prompt: str) -> dict[str, Any]:
    """One request to the pool Service's OpenAI-compatible API (`/v1/chat/completions`), as any OpenAI client
    sends it."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 24, "temperature": 0}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        done = json.loads(response.read())
    choice = done["choices"][0]
    log(f"OpenAI API (Service port {port}) answered: {choice['message']['content']!r}")
    return {"model": done["model"], "content": choice["message"]["content"], "finish_reason": choice["finish_reason"],
            "completion_tokens": done["usage"]["completion_tokens"]}


def summary(bodies: dict[str, dict[str, Any]], artifacts: dict[str, Any], answer: dict[str, Any],
            autoscaling: dict[str, Any], served: dict[str, Any], seconds: float) -> dict[str, Any]:
    """What the demo shows, as JSON: before/after from the Jobs' reports, the gate from the status, the answer,
    the served pool's HPA, and every pool's sizing."""
    local = next(b for b in bodies.values() if b["spec"]["compression"]["targetGPU"] == "cpu")
    report, quantized = artifacts["compression"], artifacts["quantization"]
    parent, child = report["parent"], report["child"]
    return {
        "seconds": round(seconds, 1),
        "model": local["metadata"]["name"],
        "parent": {"params": parent["params"], "bf16_bytes": 2 * parent["params"],
                   "decode_tokens_per_second": parent["decode_tokens_per_second"],
                   "perplexity": parent["quality"]["perplexity"]},
        "child": {"params": child["params"], "bf16_bytes": 2 * child["params"], "pattern": child["pattern"],
                  "decode_tokens_per_second": child["decode_tokens_per_second"],
                  "perplexity": child["quality"]["perplexity"], "kl_to_parent": report["kl_to_parent"]},
        "speedup": {"measured": report["measured_speedup"], "predicted": report["predicted_speedup"],
                    "measured_on": report["measured_on"]},
        "compute": report["compute"],
        "served_speedup": served,
        "quantized": {"recipe": quantized["recipe"], "bytes": quantized["bytes_after"],
                      "perplexity_before": quantized["unquantized"]["quality"]["perplexity"],
                      "perplexity_after": quantized["quantized"]["quality"]["perplexity"],
                      "kl_to_unquantized": quantized["quantized"]["quality"]["kl"]},
        "quality_gate": local["status"].get("quality"),
        "stage_seconds": {s["name"]: _seconds(s) for s in local["status"].get("stages", [])},
        "answer": answer,
        "autoscaling": autoscaling,
        "pools": [{"model": name, "contextLength": body["spec"]["deployment"]["contextLength"], **pool}
                  for name, body in bodies.items() for pool in body["status"].get("pools", [])],
    }


def served_line(served: dict[str, Any]) -> str:
    """status.servedSpeedup in a line: each ratio and its share of the prediction, or why nothing was measured."""
    if served.get("state") != "Measured":
        return f"{served.get('state')}: {served.get('message')}"
    predicted = served.get("predicted")
    rounds = max(len(r["perRound"]) for r in served["ratios"])
    return (", ".join(f"{r['ratio']:.2f}x at concurrency {r['concurrency']}" + (" (contended)" if r["contended"]
                                                                                else "") for r in served["ratios"])
            + f" measured through Triton + vLLM by the operator's speed Job, child vs parent interleaved over "
            f"{rounds} rounds" + (f" ({predicted:.2f}x predicted: " + ", ".join(
                f"{r['ratio'] / predicted:.2f} of it at {r['concurrency']}" for r in served["ratios"]) + ")"
                if predicted else ""))


def render(report: dict[str, Any]) -> str:
    """The summary as a person reads it."""
    parent, child, quant, gate = report["parent"], report["child"], report["quantized"], report["quality_gate"]
    speed, served = report["speedup"], report["served_speedup"]
    stages = ", ".join(f"{name} {s:.0f}s" for name, s in report["stage_seconds"].items() if s is not None)
    lines = [
        "", f"== {report['model']}: compressed, quantized, gated and served on this machine ==",
        f"  parameters      {parent['params'] / 1e6:.1f}M -> {child['params'] / 1e6:.1f}M ({child['pattern']})",
        f"  weights         {parent['bf16_bytes'] / 1e6:.1f} MB (BF16) -> {child['bf16_bytes'] / 1e6:.1f} MB (BF16) "
        f"-> {quant['bytes'] / 1e6:.1f} MB ({quant['recipe']})",
        f"  decode speed    {parent['decode_tokens_per_second']:.1f} -> {child['decode_tokens_per_second']:.1f} "
        f"tokens/s: {speed['measured']:.2f}x measured ({speed['predicted']:.2f}x predicted), {speed['measured_on']}",
        "  served speed-up " + served_line(served),
        f"  compute dtype   {report['compute']['dtype']} (every compression stage): {report['compute']['reason']}",
        f"  perplexity      Puzzle: {parent['perplexity']:.1f} -> {child['perplexity']:.1f} (KL to the parent "
        f"{child['kl_to_parent']:.3f}); {quant['recipe']}: {quant['perplexity_before']:.1f} -> "
        f"{quant['perplexity_after']:.1f} (KL {quant['kl_to_unquantized']:.3f}), each on its own held-out text",
        f"  quality gate    retention {gate['retention']:.3f} of the parent's {gate['metric']} "
        f"({gate['childScore']:.4f} / {gate['parentScore']:.4f}): {'passed' if gate['passed'] else 'FAILED'}",
        f"  stages          {stages}",
        f"  Triton answer   {report['answer']['prompt']}{report['answer']['answer']!r} "
        f"({report['answer']['tokens']} tokens in {report['answer']['seconds']:.1f}s)",
        f"  engine          {report['answer']['engine']}" + "".join(f"; {note}" for note in report['answer']['notes']),
        *([f"  OpenAI API      POST /v1/chat/completions {{\"model\": \"{report['answer']['openai']['model']}\", "
           f"\"messages\": [{{\"role\": \"user\", \"content\": {json.dumps(report['answer']['prompt'])}}}]}}: "
           f"{report['answer']['openai']['content']!r} ({report['answer']['openai']['finish_reason']}, "
           f"{report['answer']['openai']['completion_tokens']} tokens)"]
          if report["answer"].get("openai") else []),
        *([f"  concurrency     {report['answer']['predicted_concurrency']} requests predicted by the sizing for "
           f"the KV cache given to the engine; the engine reports {report['answer']['engine_concurrency']:.2f}"]
          if report["answer"].get("engine_concurrency") is not None else []),
        f"  autoscaling     HPA {report['autoscaling']['name']}: "
        + ", ".join(f"{m['name']} {m['current']}/{m['target']}" for m in report["autoscaling"]["metrics"])
        + f"; {report['autoscaling']['replicas']} replica(s) in [{report['autoscaling']['minReplicas']}, "
          f"{report['autoscaling']['maxReplicas']}]",
        "", "== Triton sizing per node pool (the operator's, from each child's architecture) ==",
        f"  {'model':<20} {'pool':<6} {'GPU':<24} {'engine':<13} {'context':>8} {'GPUs/replica':>12} "
        f"{'requests/GPU':>12} {'replicas':>8}"]
    for pool in report["pools"]:
        if pool.get("skipped"):
            lines.append(f"  {pool['model']:<20} {pool['name']:<6} skipped: {pool['skipped']}")
        else:
            lines.append(f"  {pool['model']:<20} {pool['name']:<6} {pool.get('gpuProduct', ''):<24} "
                         f"{pool.get('engine') or '':<13} {pool['contextLength']:>8} "
                         f"{pool.get('gpusPerReplica', 0):>12} "
                         f"{pool.get('concurrencyPerGpu', 0):>12} {pool.get('replicas', 0):>8}")
    return "\n".join(lines)
