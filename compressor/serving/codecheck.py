"""The code a served model runs, held to what its package Job wrote.

Triton runs each model's `model.py` (tailor's backend) as its `config.pbtxt` says; vLLM takes its engine arguments
from `model.json` and, with trust_remote_code, runs the checkpoint's config class (`configuration_*.py`, named in
its `config.json`). All of them sit on the artifacts claim, which any pod of the namespace that mounts it may
write. The package Job hands back their SHA-256 digests (`PackageResult.code`, `digests`); the operator records
them (an immutable ConfigMap) and puts them in each Triton container's environment, whose command checks them with
the image's own `sha256sum` before it starts tritonserver (`checked`): a changed or missing file stops the
container, naming the file, and the revision fails with that message. Light: the operator imports it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path

from tailor.compressor.results import MAX_CODE_FILES

CODE_ENV = "TAILOR_CODE_SHA256"  # the digests, as `sha256sum --check` reads them
# Run by the image's shell: $1 the folder the paths are relative to, then the server's command line.
CHECK_SCRIPT = (
    'cd "$1" && shift && printf "%s\\n" "$' + CODE_ENV + '" | sha256sum --check --strict --quiet - 1>&2 '
    '|| { echo "tailor: the model repository\'s code is not what its package Job wrote (above): not served" >&2; '
    'exit 3; }; exec "$@"')
CHECK_NAME = "tailor-code-check"  # the script's $0, as `ps` shows it


def code_files(repository: Path) -> list[Path]:
    """The files of a model repository that decide what code runs: each model's config.pbtxt, and in each version
    folder model.py, model.json, the checkpoint's config.json and every Python file under the checkpoint."""
    found: list[Path] = []
    for model in sorted(p for p in repository.iterdir() if p.is_dir()):
        found.append(model / "config.pbtxt")
        for version in sorted(p for p in model.iterdir() if p.is_dir()):
            found += [f for f in (version / "model.py", version / "model.json") if f.is_file()]
            checkpoint = version / "checkpoint"
            if (checkpoint / "config.json").is_file():
                found.append(checkpoint / "config.json")
            found += sorted(checkpoint.rglob("*.py"))
    return found


def digests(root: Path, repositories: list[Path]) -> dict[str, str]:
    """{path relative to `root`: SHA-256} of the code files of `repositories` (folders under `root`)."""
    files = [file for repository in repositories for file in code_files(repository)]
    if len(files) > MAX_CODE_FILES:
        raise ValueError(f"{len(files)} code files in {', '.join(map(str, repositories))}; a package holds at "
                         f"most {MAX_CODE_FILES}")
    return {file.relative_to(root).as_posix(): hashlib.sha256(file.read_bytes()).hexdigest() for file in files}


def checked(root: str, code: Mapping[str, str], argv: list[str]) -> tuple[list[str], list[str], str]:
    """A container's command and args that check `code` (paths relative to `root` as the container sees it) and
    then run `argv`, and the value of CODE_ENV they read."""
    lines = "\n".join(f"{digest}  {path}" for path, digest in sorted(code.items()))
    return ["sh", "-c", CHECK_SCRIPT, CHECK_NAME], [root, *argv], lines
