"""The images built for real, and their entry points run: `images/build.py` for the images named (both by
default), then in each image, with `buildah run` (chroot isolation: podman cannot run a container here):

- operator: `tailor --help`; torch, modelopt and vLLM are not installed;
- runtime: `tailor --help`, `tritonserver --help`, torch and modelopt imported (torch's CUDA version), and one
  model load: SmolLM2-135M packaged for the Python fallback engine (`tailor package --engine tailor-python`),
  served by the image's `tritonserver` on loopback as uid 1000, answering one request.

    .venv/bin/python bench/images.py [operator] [runtime] [--no-build] [--out bench/results/images.json]

Writes each image's size (unpacked, and its OCI archive), its build time and the checks' outcomes, all measured.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tailor.compressor.serving import client
from tailor.devcluster import images
from tailor.devcluster.executor import free_port, loopback_args
from tailor.devcluster.log import log

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"
READY_TIMEOUT_S = 600


def check(what: str, done: subprocess.CompletedProcess[str], expect: str, code: int = 0) -> dict[str, object]:
    """`done` exited with `code` and printed `expect` (on either stream)."""
    passed = done.returncode == code and expect in done.stdout + done.stderr
    log(f"  {what}: {'ok' if passed else 'FAILED'}")
    return {"check": what, "passed": passed, "output": (done.stdout + done.stderr).strip()[-400:]}


def serve_one_request(image: str, scratch: Path) -> dict[str, object]:
    """SmolLM2-135M for the Python fallback engine, served by the image's tritonserver; one request."""
    package = scratch / "package"
    subprocess.run([str(ROOT / ".venv" / "bin" / "tailor"), "package", "--model", MODEL, "--engine", "tailor-python",
                    "--gpu", "cpu", "--name", "smollm2", "--out", str(package), "--mount", "/models"],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["chmod", "-R", "a+rX", str(scratch)], check=True)
    http, grpc, metrics = (free_port() for _ in range(3))
    server_log = scratch / "tritonserver.log"
    started = time.monotonic()
    with images.working_container(image) as name:
        server = images.start(name, loopback_args([
            "tritonserver", "--model-repository=/models/repository", f"--http-port={http}", f"--grpc-port={grpc}",
            f"--metrics-port={metrics}"]), server_log, user="1000:1000", volumes={"/models": package})
        try:
            while time.monotonic() - started < READY_TIMEOUT_S and server.poll() is None:
                try:
                    answer = client.infer(f"127.0.0.1:{http}", "smollm2", prompt="The capital of France is",
                                          max_tokens=8, timeout=60)
                    break
                except Exception:  # not ready yet: the model loads
                    time.sleep(2)
            else:
                tail = server_log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"tritonserver in {image} did not answer within {READY_TIMEOUT_S}s:\n{tail}")
        finally:
            images.stop(server)
    seconds = round(time.monotonic() - started, 1)
    log(f"  one model load and request: {answer.text!r} in {seconds:.0f}s")
    return {"check": "tritonserver loads SmolLM2-135M (Python fallback engine) and answers", "passed": True,
            "output": answer.text, "seconds": seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", metavar="IMAGE", help="operator, runtime (default: both)")
    parser.add_argument("--no-build", action="store_true", help="check the images build/images/images.json names")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "images.json")
    args = parser.parse_args()
    names = args.names or ["operator", "runtime"]
    if not args.no_build:
        subprocess.run([sys.executable, str(ROOT / "images" / "build.py"), *names], check=True)
    built = {image["name"]: image for image in json.loads((ROOT / "build" / "images" / "images.json").read_text())}
    results = []
    for image_name in names:
        image = built[image_name]
        log(f"{image['reference']}: {image['image_bytes'] / 1e6:.0f} MB unpacked, archive "
            f"{image['archive_bytes'] / 1e6:.0f} MB")
        checks = []
        with images.working_container(image["reference"]) as name:
            checks.append(check("tailor --help", images.run(name, ["tailor", "--help"]), "operator"))
            if image_name == "operator":
                checks.append(check("no torch, modelopt or vLLM", images.run(name, [
                    "python", "-c", "import importlib.util as u; print([m for m in ('torch', 'modelopt', 'vllm') "
                                    "if u.find_spec(m)])"]), "[]"))
            else:
                # tritonserver prints its usage on stderr and exits 1, as it does for any argument it stops at
                checks.append(check("tritonserver --help", images.run(name, ["tritonserver", "--help"]),
                                    "--model-repository", code=1))
                checks.append(check("torch and modelopt import", images.run(name, [
                    "python", "-c", "import torch, modelopt.torch.quantization; print('cuda', torch.version.cuda)"]),
                    "cuda 1"))
        if image_name == "runtime":
            with tempfile.TemporaryDirectory(prefix="tailor-images-") as scratch:
                checks.append(serve_one_request(image["reference"], Path(scratch)))
        results.append({**image, "checks": checks})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(c["passed"] for r in results for c in r["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
