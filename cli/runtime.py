"""`tailor runtime`: the versions that serve, named once in serving.toml, and the package locks made from it."""

from __future__ import annotations

import argparse
import sys
from typing import Any

EXAMPLES = """examples:
  tailor runtime check    # exit 1 when the two locks leave serving.toml or each other, or vLLM's CPU build
                          # (.venv-vllm) runs other code than its CUDA build (read from the index), each named
  tailor runtime lock     # resolve constraints-serving-gpu.txt against the package index (about a minute)
"""


def _runtime(args: argparse.Namespace) -> int:
    from tailor.devcluster import servingruntime as runtime

    serving = runtime.ServingRuntime.load()
    cpu = runtime.read_lock(runtime.CPU_LOCK)
    if args.verb == "lock":
        print(f"resolving {runtime.GPU_LOCK.name} for CPython {serving.gpu.python}, glibc {serving.gpu.glibc}",
              file=sys.stderr)
        pins = runtime.resolve_gpu_lock(serving, cpu)
        partial = runtime.GPU_LOCK.with_name(runtime.GPU_LOCK.name + ".partial")
        partial.write_text(runtime.render_gpu_lock(serving, pins))
        partial.rename(runtime.GPU_LOCK)
        print(f"wrote {runtime.GPU_LOCK.name}: {len(pins)} packages", file=sys.stderr)
    found = runtime.disagreements(serving, cpu, runtime.read_lock(runtime.GPU_LOCK))
    if args.verb == "check":
        cuda_build = runtime.index_wheel_record(runtime.GPU_VLLM, serving.engine.vllm)
        cpu_build = runtime.installed_record(runtime.CPU_PYTHON, runtime.CPU_VLLM)
        found += [f"vLLM's builds differ: {path}" for path in runtime.engine_code_differences(cpu_build, cuda_build)]
    for line in found:
        print(line, file=sys.stderr)
    return 1 if found else 0


def add_parser(nouns: Any) -> None:
    parser = nouns.add_parser("runtime", help="the serving runtime's versions (serving.toml) and its package locks",
                              epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="verb", required=True)
    verbs.add_parser("check", help="the devcluster's and the serving image's locks against serving.toml and each "
                                   "other; vLLM's CPU build in .venv-vllm against its CUDA build on the index, file "
                                   "by file")
    verbs.add_parser("lock", help="resolve the serving image's lock (constraints-serving-gpu.txt) from serving.toml "
                                  "and constraints-vllm.txt, then check")
    parser.set_defaults(run=_runtime)
