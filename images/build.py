"""Build Tailor's container images with buildah, from sources this machine reaches: a Debian 12 root filesystem
made by debootstrap from Debian's packages (no image registry), then `images/Dockerfile`'s target on it (its
packages from Debian, its Python packages from the package index, pinned by `constraints.txt`). Each image is
written as an OCI archive, `build/images/tailor-<name>-<version>.oci.tar`, and kept in buildah's local storage as
`localhost/tailor-<name>:<version>`; `build/images/images.json` reports the sizes.

    .venv/bin/python images/build.py [operator] [runtime] [serving] [--out build/images] [--mirror URL]

Needs root (debootstrap, and buildah's chroot isolation: no daemon, no user namespace) and Debian's buildah,
podman and debootstrap (`make images` installs them). Behind a TLS-inspecting proxy the build machine's trust store
(`PIP_CERT` or `SSL_CERT_FILE`) reaches the builds as the secret `pip-cert`, in no layer.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

from pydantic import BaseModel

from tailor.devcluster import images, servingruntime
from tailor.devcluster.log import log

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ("operator", "runtime", "serving")
# built unless others are named; `serving` starts from NVIDIA's Triton image, pulled from NGC (nvcr.io), which the
# development machines do not reach
DEFAULT_IMAGES = ("operator", "runtime")
SUITE = "bookworm"  # Debian 12, as the Dockerfiles' default base
MIRROR = "http://deb.debian.org/debian"
BASE = f"localhost/tailor-debian:{SUITE}"
# what debian:bookworm-slim leaves out of a root filesystem: documentation (but for the copyright files), manuals
# and translations, also in later installs (dpkg's path-exclude); and the package cache and lists
SLIM_FOLDERS = ("usr/share/doc", "usr/share/man", "usr/share/info", "usr/share/locale", "usr/share/lintian")
SLIM_KEEP = "/usr/share/doc/*/copyright"


class Built(BaseModel):
    """One image, as `images.json` reports it (all measured)."""

    name: str
    reference: str  # in buildah's local storage
    archive: str  # the OCI archive, relative to the repository
    archive_bytes: int
    image_bytes: int  # its layers unpacked
    build_seconds: float


def _run(argv: list[str], show: bool = False) -> str:
    """Run a tool; its output is returned, or shown as it comes with `show` (buildah's build steps)."""
    return subprocess.run(argv, check=True, text=True, stdout=None if show else subprocess.PIPE).stdout or ""


def _image_exists(reference: str) -> bool:
    return subprocess.run(["buildah", "inspect", "--type", "image", reference], capture_output=True).returncode == 0


def base_image(mirror: str) -> str:
    """The Debian base in buildah's storage (made once; `buildah rmi localhost/tailor-debian:bookworm` has the
    next build make it again, with Debian's updates): debootstrap's minbase variant, slimmed as debian:bookworm-slim
    is; its packages and versions are in the image's /var/lib/dpkg/status."""
    if _image_exists(BASE):
        return BASE
    with tempfile.TemporaryDirectory(prefix="tailor-debian-") as scratch:
        rootfs = Path(scratch) / "rootfs"
        log(f"base: debootstrap --variant=minbase {SUITE} from {mirror}")
        _run(["debootstrap", "--variant=minbase", SUITE, str(rootfs), mirror])
        _slim(rootfs)
        security = mirror.rstrip("/").removesuffix("/debian") + "/debian-security"
        (rootfs / "etc/apt/sources.list").write_text(f"deb {mirror} {SUITE} main\ndeb {mirror} {SUITE}-updates main\n"
                                                     f"deb {security} {SUITE}-security main\n")
        container = _run(["buildah", "from", "scratch"]).strip()
        try:
            _run(["buildah", "copy", "--quiet", container, str(rootfs), "/"])
            _run(["buildah", "config", "--cmd", "/bin/bash", "--env", "LANG=C.UTF-8",
                  "--label", f"org.opencontainers.image.source=debootstrap --variant=minbase {SUITE} {mirror}",
                  container])
            _run(["buildah", "commit", "--quiet", "--rm", container, BASE])
        except subprocess.CalledProcessError:
            subprocess.run(["buildah", "rm", container], capture_output=True)
            raise
    log(f"base: {BASE}")
    return BASE


def _slim(rootfs: Path) -> None:
    (rootfs / "etc/apt/apt.conf.d/slim").write_text('Acquire::Languages "none";\n')  # no translations' lists
    (rootfs / "etc/dpkg/dpkg.cfg.d/slim").write_text(
        "".join(f"path-exclude /{folder}/*\n" for folder in SLIM_FOLDERS) + f"path-include {SLIM_KEEP}\n")
    for folder in SLIM_FOLDERS:
        for path in sorted((rootfs / folder).rglob("*"), reverse=True):  # files before their folders
            if path.name == "copyright" and folder == "usr/share/doc":
                continue
            if path.is_dir() and not path.is_symlink():
                if not any(path.iterdir()):
                    path.rmdir()
            else:
                path.unlink()
    for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for path in (rootfs / cache).glob("*"):
            if path.is_file():
                path.unlink()


def _trust_store() -> Path | None:
    for name in ("PIP_CERT", "SSL_CERT_FILE"):
        if (value := os.environ.get(name)) and Path(value).is_file():
            return Path(value)
    return None


def build(name: str, base: str, out: Path) -> Built:
    """`images/Dockerfile`'s target `name` on `base`, committed to local storage and written as an OCI archive
    (through a temporary name: an archive that is there is complete)."""
    tag = version("tailor")
    reference = f"localhost/tailor-{name}:{tag}"
    started = time.monotonic()
    serving_base = servingruntime.ServingRuntime.load().gpu.base
    argv = ["buildah", "bud", "--isolation", "chroot", "--layers", "--build-arg", f"BASE={base}",
            "--build-arg", f"SERVING_BASE={serving_base}",
            "--file", str(ROOT / "images" / "Dockerfile"), "--target", name, "--tag", reference]
    if (store := _trust_store()) is not None:
        argv += ["--secret", f"id=pip-cert,src={store}"]
    log(f"{name}: buildah bud --target {name} images/Dockerfile -> {reference}")
    _run([*argv, str(ROOT)], show=True)
    archive = out / f"tailor-{name}-{tag}.oci.tar"
    partial = archive.with_name(archive.name + ".partial")
    partial.unlink(missing_ok=True)
    log(f"{name}: writing {_shown(archive)}")
    _run(["buildah", "push", "--quiet", reference, f"oci-archive:{partial}:{tag}"])
    partial.rename(archive)
    return Built(name=name, reference=reference, archive=_shown(archive), archive_bytes=archive.stat().st_size,
                 image_bytes=images.image_bytes(reference), build_seconds=round(time.monotonic() - started, 1))


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", metavar="IMAGE",
                        help=f"of {', '.join(IMAGES)} (default: {', '.join(DEFAULT_IMAGES)})")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "images")
    parser.add_argument("--mirror", default=MIRROR, help="the Debian mirror debootstrap installs from")
    args = parser.parse_args()
    if unknown := set(args.names) - set(IMAGES):
        parser.error(f"no image {', '.join(sorted(unknown))}: the images are {', '.join(IMAGES)}")
    missing = [tool for tool in ("buildah", "podman", "debootstrap") if shutil.which(tool) is None]
    if missing:
        print(f"error: {', '.join(missing)} not found: `make images` installs them (Debian packages)",
              file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("error: building images needs root here (debootstrap, buildah's chroot isolation); elsewhere use "
              "`docker build -f images/Dockerfile --target <name> .`", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    base = base_image(args.mirror)
    report = args.out / "images.json"
    built = {b["name"]: b for b in json.loads(report.read_text())} if report.exists() else {}
    for name in args.names or DEFAULT_IMAGES:
        image = build(name, base, args.out)
        built[name] = image.model_dump()
        log(f"{name}: {image.reference}, {image.image_bytes / 1e6:.0f} MB unpacked, archive "
            f"{image.archive_bytes / 1e6:.0f} MB, {image.build_seconds:.0f} s")
    partial = report.with_name(report.name + ".partial")
    partial.write_text(json.dumps(list(built.values()), indent=1) + "\n")
    partial.rename(report)
    print(f"wrote {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
