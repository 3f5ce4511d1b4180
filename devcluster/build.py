"""Build the control-plane binaries from Go modules into a cache keyed by the pinned versions.

No prebuilt Kubernetes binaries are reachable from our machines, but the Go module proxy is:
kube-apiserver, kube-controller-manager, kube-scheduler and kubectl build from `k8s.io/kubernetes`
through the wrapper module in `kube/`, etcd is embedded from `go.etcd.io/etcd/server/v3` in the same
module graph, and kwok and helm install from their own modules. A build lands in
`<cache>/bin-<key>/`, where the key hashes everything that pins a version, so a change of pin
rebuilds and an unchanged one starts at once.

The metrics pipeline (Prometheus and prometheus-adapter, for the custom metrics API the HPAs read) is a set of
its own, `<cache>/metrics-<key>/`, so that its pins do not rebuild Kubernetes. Prometheus is built with only its
built-in file and static service discoveries (the `remove_all_sd` build tag).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from tailor.devcluster.log import log

KUBE_MODULE = Path(__file__).parent / "kube"
KWOK_VERSION = "v0.8.0"
HELM_VERSION = "v3.21.4"

KUBE_COMMANDS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
BINARIES = ("etcd", *KUBE_COMMANDS, "kwok", "helm")

PROMETHEUS_VERSION = "v0.316.0"  # the Go module's version of Prometheus 3.16.0
ADAPTER_MODULE = Path(__file__).parent / "adapter"  # pins sigs.k8s.io/prometheus-adapter
PROMETHEUS_TAGS = "remove_all_sd"  # only the built-in file and static discoveries
METRICS_BINARIES = ("prometheus", "prometheus-adapter")
KUEUE_VERSION = "v0.17.0"
REGISTRY_VERSION = "v3.0.0"  # CNCF distribution's registry: where tests publish the chart as an OCI artifact
KUEUE_CRDS = "config/components/crd/bases"  # in Kueue's module, beside the manager


def kubernetes_version() -> str:
    """The k8s.io/kubernetes release the wrapper module pins (its go.mod is the single source)."""
    match = re.search(r"^\s*k8s\.io/kubernetes (v\d+\.\d+\.\d+)\s*$", (KUBE_MODULE / "go.mod").read_text(), re.M)
    if match is None:
        raise RuntimeError(f"{KUBE_MODULE / 'go.mod'}: no `k8s.io/kubernetes vX.Y.Z` requirement")
    return match.group(1)


def cache_root() -> Path:
    """Where built binaries live: $TAILOR_CACHE_DIR, else ~/.cache/tailor (outside any clone)."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tailor"
    return Path(os.environ.get("TAILOR_CACHE_DIR", default))


def _go_version() -> str:
    if shutil.which("go") is None:
        raise RuntimeError("`go` is not on PATH: the devcluster builds its binaries from Go modules")
    return subprocess.run(["go", "env", "GOVERSION"], check=True, capture_output=True, text=True).stdout.strip()


def build_key() -> str:
    """Hash of every input that pins what gets built."""
    digest = hashlib.sha256()
    for path in sorted([KUBE_MODULE / "go.mod", KUBE_MODULE / "go.sum", *KUBE_MODULE.glob("cmd/*/*.go")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(f"{KWOK_VERSION} {HELM_VERSION} {_go_version()}".encode())
    return digest.hexdigest()[:16]


def _version_ldflags(version: str) -> str:
    """Stamp the true release into the binaries (else they report v0.0.0 and kubeVersion checks break)."""
    major, minor = version.lstrip("v").split(".")[:2]
    flags = ["-s", "-w"]
    for package in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [
            f"-X {package}.gitVersion={version}",
            f"-X {package}.gitMajor={major}",
            f"-X {package}.gitMinor={minor}",
            f"-X {package}.gitTreeState=clean",
        ]
    return " ".join(flags)


def _run_go(args: list[str], *, cwd: Path, env: dict[str, str], what: str) -> None:
    started = time.monotonic()
    log(f"building {what} ...")
    result = subprocess.run(["go", *args], cwd=cwd, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"go {' '.join(args[:2])} for {what} failed:\n{result.stderr[-4000:]}")
    log(f"built {what} in {time.monotonic() - started:.0f}s")


def _build(target: Path, names: tuple[str, ...], what: str, steps: Callable[[Path, dict[str, str]], None]) -> Path:
    """`target`, holding every one of `names`, built by `steps(staging, env)` into a staging folder first (renamed
    when complete, so a build cut short never looks done)."""
    if all((target / name).exists() for name in names):
        return target
    staging = target.with_name(f"{target.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    started = time.monotonic()
    steps(staging, {**os.environ, "GOFLAGS": "-buildvcs=false", "GOBIN": str(staging)})
    missing = [name for name in names if not (staging / name).exists()]
    if missing:
        raise RuntimeError(f"build finished without {', '.join(missing)} in {staging}")
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    log(f"{what} ready in {target} after {time.monotonic() - started:.0f}s")
    return target


def ensure_binaries() -> Path:
    """Return the folder holding every devcluster binary, building it first if the pins changed."""
    def steps(staging: Path, env: dict[str, str]) -> None:
        version = kubernetes_version()
        log(f"building the devcluster binaries (Kubernetes {version}, kwok {KWOK_VERSION}, helm {HELM_VERSION}); "
            "a cold build takes about 7 minutes on 2 cores; later starts reuse it")
        packages = [f"k8s.io/kubernetes/cmd/{name}" for name in KUBE_COMMANDS] + ["./cmd/etcd"]
        _run_go(["build", "-o", f"{staging}/", "-ldflags", _version_ldflags(version), *packages],
                cwd=KUBE_MODULE, env=env, what="etcd, " + ", ".join(KUBE_COMMANDS))
        _run_go(["install", "-ldflags", "-s -w", f"sigs.k8s.io/kwok/cmd/kwok@{KWOK_VERSION}"],
                cwd=staging, env=env, what=f"kwok {KWOK_VERSION}")
        _run_go(["install", "-ldflags", f"-s -w -X helm.sh/helm/v3/internal/version.version={HELM_VERSION}",
                 f"helm.sh/helm/v3/cmd/helm@{HELM_VERSION}"], cwd=staging, env=env, what=f"helm {HELM_VERSION}")

    return _build(cache_root() / f"bin-{build_key()}", BINARIES, "devcluster binaries", steps)


def adapter_version() -> str:
    """The prometheus-adapter release the wrapper module pins."""
    pattern = r"^\s*(?:require\s+)?sigs\.k8s\.io/prometheus-adapter (v\S+)\s*$"
    match = re.search(pattern, (ADAPTER_MODULE / "go.mod").read_text(), re.M)
    if match is None:
        raise RuntimeError(f"{ADAPTER_MODULE / 'go.mod'}: no `sigs.k8s.io/prometheus-adapter vX.Y.Z` requirement")
    return match.group(1)


def ensure_metrics_binaries() -> Path:
    """Return the folder holding Prometheus and prometheus-adapter, building them first if the pins changed."""
    key = hashlib.sha256(f"{PROMETHEUS_VERSION} {PROMETHEUS_TAGS} {_go_version()}".encode())
    for path in (ADAPTER_MODULE / "go.mod", ADAPTER_MODULE / "go.sum"):
        key.update(path.read_bytes())

    def steps(staging: Path, env: dict[str, str]) -> None:
        log(f"building the metrics pipeline (Prometheus {PROMETHEUS_VERSION}, prometheus-adapter "
            f"{adapter_version()}); a cold build takes about 4 minutes on 2 cores; later starts reuse it")
        _run_go(["install", "-tags", PROMETHEUS_TAGS, "-ldflags", "-s -w",
                 f"github.com/prometheus/prometheus/cmd/prometheus@{PROMETHEUS_VERSION}"],
                cwd=staging, env=env, what=f"prometheus {PROMETHEUS_VERSION}")
        _run_go(["build", "-o", str(staging / "prometheus-adapter"), "-ldflags", "-s -w",
                 "sigs.k8s.io/prometheus-adapter/cmd/adapter"],
                cwd=ADAPTER_MODULE, env=env, what=f"prometheus-adapter {adapter_version()}")

    return _build(cache_root() / f"metrics-{key.hexdigest()[:16]}", METRICS_BINARIES, "metrics binaries", steps)


def ensure_kueue_binaries() -> Path:
    """Return the folder holding Kueue's manager (`kueue`) and its CRDs (`crds/`), building it first if the pin
    changed."""
    key = hashlib.sha256(f"{KUEUE_VERSION} {_go_version()}".encode()).hexdigest()[:16]

    def steps(staging: Path, env: dict[str, str]) -> None:
        log(f"building Kueue {KUEUE_VERSION}; a cold build takes about 3 minutes on 2 cores; later starts reuse it")
        _run_go(["install", "-ldflags", "-s -w", f"sigs.k8s.io/kueue/cmd/kueue@{KUEUE_VERSION}"], cwd=staging,
                env=env, what=f"kueue {KUEUE_VERSION}")
        module = subprocess.run(["go", "list", "-m", "-json", f"sigs.k8s.io/kueue@{KUEUE_VERSION}"], cwd=staging,
                                env=env, check=True, capture_output=True, text=True).stdout
        (staging / "crds").mkdir()
        for crd in (Path(json.loads(module)["Dir"]) / KUEUE_CRDS).glob("*.yaml"):  # writable copies, unlike the cache's
            shutil.copyfile(crd, staging / "crds" / crd.name)

    return _build(cache_root() / f"kueue-{key}", ("kueue", "crds"), "Kueue", steps)


def ensure_registry_binaries() -> Path:
    """Return the folder holding the OCI registry (`registry`, CNCF distribution), building it first if the pin
    changed."""
    key = hashlib.sha256(f"{REGISTRY_VERSION} {_go_version()}".encode()).hexdigest()[:16]

    def steps(staging: Path, env: dict[str, str]) -> None:
        log(f"building the OCI registry (distribution {REGISTRY_VERSION}); a cold build takes about a minute")
        _run_go(["install", "-ldflags", "-s -w",
                 f"github.com/distribution/distribution/v3/cmd/registry@{REGISTRY_VERSION}"], cwd=staging, env=env,
                what=f"registry {REGISTRY_VERSION}")

    return _build(cache_root() / f"registry-{key}", ("registry",), "the OCI registry", steps)
