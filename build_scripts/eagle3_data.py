"""An EAGLE-3 head's training data, computed once and kept in shards beside the model (not in the repository), so
that data can be added in several runs and a run killed at any point loses at most the shard it was writing.

    python build_scripts/eagle3_data.py --target <target dir or .gguf> --data <dir> [--source stdlib=64 ...]

What a shard holds: windows of `--length` tokens (ids), the target's three feature layers and last layer's output
at every position, and the target's top-1 there: what `train_eagle3.py` trains from (the target's distribution is
computed from the last hidden state during training; nothing vocabulary-sized is stored).

Sources (each a list of documents on this machine, in a fixed order; none is HumanEval, the evaluation set):

    stdlib          the Python standard library's top-level modules
    stdlib-pkgs     the standard library's packages (json/, email/, asyncio/, ...; their tests excluded)
    site-packages   the sources of the installed packages (tests and anything named like HumanEval excluded)
    docstrings      functions with a docstring in all of the above, cut after the docstring: HumanEval's shape
                    (signature and docstring, preceded by the file's own context)

Kinds: `text` windows are read as they are (one batched forward each: the labels are still the target's own
distributions); `regen` and `docstrings` windows keep their first `--prompt-len` tokens and are continued by the
target itself (even windows greedy, odd sampled at temperature 0.8), one forward per generated token.

Held-out split by file: a document is held out when a hash of its name says so (1 in 10), whatever the other
sources or counts (vendored copies of the standard library in installed packages are not read, so a held-out
module does not come back under another path); `--source NAME[:KIND]=N` asks for N training windows of that
source, in whole shards of 32, and one shard of 32 from its held-out documents. Shard k of a source is drawn from
its own seed (seed, source, kind, split, k), so asking for more windows later adds shards and leaves the existing
ones as they were.

Resuming: `manifest.json` lists the finished shards (atomically replaced after each); a shard is written to a
temporary name and renamed when complete. Running again skips what the manifest lists; a run for another target,
window length, dtype or seed is refused by name, and so is one whose source files changed while shards of that
source are still to be drawn (start a new directory). A run with `--time-limit` starts no shard that the
manifest's earlier shards of its kind say would not end in time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from echo_trtllm.models.llama import CausalLM  # noqa: E402

MANIFEST = "manifest.json"
FORMAT = 1
SOURCES = ("stdlib", "stdlib-pkgs", "site-packages", "docstrings")
KINDS = ("text", "regen")
WINDOWS_PER_SHARD = 32
# tests, caches, HumanEval, and vendored copies of the standard library (a held-out module must not come back in
# training under another path)
_EXCLUDE = re.compile(r"(^|/)(tests?|test_[^/]*|idle_test|__pycache__|_vendor|vendored|_distutils|backports)(/|$)"
                      r"|human_?eval", re.IGNORECASE)


# ---------------------------------------------------------------------------------------------------- documents


def _py_files(root: Path, pattern: str, prefix: str) -> list[tuple[str, Path]]:
    out = []
    for p in sorted(root.glob(pattern)):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and not _EXCLUDE.search(rel):
            out.append((f"{prefix}/{rel}", p))
    return out


def source_files(source: str) -> list[tuple[str, Path]]:
    """(stable name, path) of a source's documents, sorted by name."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    if source == "stdlib":
        return _py_files(stdlib, "*.py", "stdlib")
    if source == "stdlib-pkgs":
        return [(n, p) for n, p in _py_files(stdlib, "*/**/*.py", "stdlib")
                if not n.startswith(("stdlib/site-packages/", "stdlib/lib2to3/"))]
    if source == "site-packages":
        return _py_files(Path(sysconfig.get_paths()["purelib"]), "*/**/*.py", "site-packages")
    if source == "docstrings":
        return [f for s in ("stdlib", "stdlib-pkgs", "site-packages") for f in source_files(s)]
    raise ValueError(f"source must be one of {', '.join(SOURCES)}, got {source!r}")


def held_out(name: str) -> bool:
    """The fixed split by file: 1 document in 10, by a hash of its name."""
    return int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) % 10 == 3


def fingerprint(files: list[tuple[str, Path]]) -> str:
    """What a plan drew from: the documents' names and sizes."""
    h = hashlib.sha256()
    for name, path in files:
        h.update(f"{name}\0{path.stat().st_size}\n".encode())
    return h.hexdigest()[:16]


_DOCSTRING = re.compile(r'^([ \t]*)(?:async[ \t]+)?def[ \t]+\w+\(.*?\).*?:[ \t]*\n[ \t]+(?:"""|\'\'\')[\s\S]*?(?:"""|\'\'\')[ \t]*\n',
                        re.MULTILINE)


def docstring_cuts(text: str) -> list[int]:
    """Character offsets just after each function's docstring (HumanEval's prompts end there)."""
    return [m.end() for m in _DOCSTRING.finditer(text)]


# ---------------------------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class DataSpec:
    """What a data directory holds: one target, one window length, one dtype (checked on every run)."""

    target: str
    length: int
    prompt_len: int
    dtype: str
    seed: int = 0

    def check(self) -> None:
        if not 2 <= self.prompt_len < self.length:
            raise ValueError(f"--prompt-len must be in [2, --length), got {self.prompt_len} with --length {self.length}")


@dataclass(frozen=True)
class Shard:
    name: str
    source: str
    kind: str
    split: str
    index: int
    windows: int


def parse_source(text: str) -> tuple[str, str, int]:
    """`NAME[:KIND]=N` -> (source, kind, windows); docstrings are always continued by the target."""
    m = re.fullmatch(r"([\w-]+)(?::(\w+))?=(\d+)", text)
    if not m:
        raise ValueError(f"--source must look like NAME[:KIND]=N (e.g. stdlib=256, site-packages:regen=64), got {text!r}")
    source, kind, n = m.group(1), m.group(2) or ("regen" if m.group(1) == "docstrings" else "text"), int(m.group(3))
    if source not in SOURCES:
        raise ValueError(f"--source {text!r}: the source must be one of {', '.join(SOURCES)}")
    if kind not in KINDS or (source == "docstrings" and kind != "regen"):
        raise ValueError(f"--source {text!r}: the kind must be one of {', '.join(KINDS)} (docstrings: regen)")
    if n < 1:
        raise ValueError(f"--source {text!r}: N must be >= 1")
    return source, kind, n


def parse_sources(texts: list[str]) -> list[tuple[str, str, int]]:
    """Every `--source`, each (source, kind) at most once."""
    out = [parse_source(t) for t in texts]
    seen = [(s, k) for s, k, _ in out]
    dup = sorted({f"{s}:{k}" for s, k in seen if seen.count((s, k)) > 1})
    if dup:
        raise ValueError(f"--source names {', '.join(dup)} more than once: give each source and kind one count")
    return out


def plan(sources: list[tuple[str, str, int]], per_shard: int = WINDOWS_PER_SHARD) -> list[Shard]:
    """The shards for these (source, kind, training windows): the training windows in whole shards of `per_shard`
    (rounded up), then one shard held out per source and kind. A shard's windows depend on its name alone, so a
    larger count keeps every shard of a smaller one."""
    out = []
    for source, kind, n in sources:
        if n <= 0:
            continue
        for k in range(-(-n // per_shard)):
            out.append(Shard(f"{source}-{kind}-train-{k:05d}", source, kind, "train", k, per_shard))
        out.append(Shard(f"{source}-{kind}-heldout-00000", source, kind, "heldout", 0, per_shard))
    return out


class Documents:
    """A source's documents of one split, tokenized when first drawn."""

    def __init__(self, tokenizer, source: str, split: str) -> None:
        self.tokenizer, self.source = tokenizer, source
        self.files = [(n, p) for n, p in source_files(source) if held_out(n) == (split == "heldout")]
        self._ids: dict[int, list[int]] = {}

    def ids(self, i: int) -> list[int]:
        if i not in self._ids:
            self._ids[i] = self.tokenizer.encode(self.files[i][1].read_text(encoding="utf-8", errors="replace"))
        return self._ids[i]

    def prompt(self, i: int, gen: torch.Generator, length: int) -> list[int] | None:
        """A HumanEval-shaped prompt from document i: the `length` tokens ending just after one of its docstrings."""
        text = self.files[i][1].read_text(encoding="utf-8", errors="replace")
        cuts = docstring_cuts(text)
        if not cuts:
            return None
        ids = self.tokenizer.encode(text[: cuts[int(torch.randint(len(cuts), (1,), generator=gen))]])
        return ids[-length:] if len(ids) >= length else None


def seed_of(key: str) -> int:
    """A generator seed from a name (the same on every machine and run)."""
    return int(hashlib.sha256(key.encode()).hexdigest()[:15], 16)


def shard_windows(shard: Shard, docs: Documents, spec: DataSpec) -> list[list[int]]:
    """The shard's windows, drawn from its own seed (module docstring); a document too short is drawn again."""
    gen = torch.Generator().manual_seed(seed_of(f"{spec.seed}/{shard.source}/{shard.kind}/{shard.split}/{shard.index}"))
    if not docs.files:
        raise ValueError(f"source {shard.source!r} has no {shard.split} documents on this machine")
    need = spec.length if shard.kind == "text" else spec.prompt_len
    out, tries = [], 0
    while len(out) < shard.windows:
        tries += 1
        if tries > 200 * shard.windows:
            raise ValueError(f"source {shard.source!r}: too few documents of {need} tokens for shard {shard.name}")
        i = int(torch.randint(len(docs.files), (1,), generator=gen))
        if shard.source == "docstrings":
            w = docs.prompt(i, gen, need)
        else:
            ids = docs.ids(i)
            w = None
            if len(ids) > need:
                start = int(torch.randint(len(ids) - need, (1,), generator=gen))
                w = ids[start : start + need]
        if w is not None:
            out.append(w)
    return out


# ---------------------------------------------------------------------------------------------------- the store


def read_manifest(data_dir: Path) -> dict | None:
    path = data_dir / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else None


def write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(obj, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_atomic(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def open_store(data_dir: Path, spec: DataSpec, shards: list[Shard]) -> dict:
    """The directory's manifest, created for this spec; refused by name when it was made for another, or when the
    documents of a source that `shards` still draw from changed (made shards stand as they are)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    for stale in data_dir.glob("*.partial"):  # a shard a killed run was writing
        stale.unlink()
    manifest = read_manifest(data_dir)
    made = manifest["shards"] if manifest is not None else {}
    fingerprints = {s: fingerprint(source_files(s)) for s in sorted({x.source for x in shards if x.name not in made})}
    if manifest is None:
        manifest = {"format": FORMAT, "spec": asdict(spec), "fingerprints": {}, "shards": {}}
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{data_dir / MANIFEST}: format {manifest.get('format')}, this script writes {FORMAT}")
    flags = {"target": "--target", "length": "--length", "prompt_len": "--prompt-len", "dtype": "--dtype (as resolved)",
             "seed": "--seed"}
    for field, value in asdict(spec).items():
        if manifest["spec"].get(field) != value:
            raise ValueError(f"--data {data_dir} holds data made with {flags[field]} {manifest['spec'].get(field)!r}, "
                             f"not {value!r}: use another --data directory, or the same {flags[field]}")
    for source, fp in fingerprints.items():
        old = manifest["fingerprints"].get(source)
        if old is not None and old != fp:
            raise ValueError(f"{data_dir}: the documents of source {source!r} changed since its shards were made "
                             f"(fingerprint {old} -> {fp}): use another --data directory")
        manifest["fingerprints"][source] = fp
    return manifest


def compute_shard(target: CausalLM, shard: Shard, windows: list[list[int]], spec: DataSpec, batch: int) -> dict:
    """The target's view of a shard's windows (module docstring), as stored."""
    import train_eagle3

    layers = target.eagle3_layers()
    if shard.kind == "text":
        ids, feats, lasts, tops = train_eagle3.capture_text(target, layers, windows, batch, quiet=True)
    else:
        ids, feats, lasts, tops = train_eagle3.generate_and_capture(target, layers, windows, spec.length - spec.prompt_len,
                                                                    seed_of(f"{spec.seed}/{shard.name}"), batch, quiet=True)
    return {"ids": ids.to(torch.int32), "features": feats, "last_hidden": lasts, "top1": tops.to(torch.int32)}


def build(target: CausalLM, tokenizer, data_dir: Path, spec: DataSpec, sources: list[tuple[str, str, int]],
          batch: int = 16, time_limit: float | None = None, log=print) -> dict:
    """Make the shards of `sources` that `data_dir`'s manifest does not list yet, in plan order, until done or
    `time_limit` seconds have passed (a shard started is finished). Returns the manifest."""
    spec.check()
    if str(target.dtype).removeprefix("torch.") != spec.dtype:
        raise ValueError(f"the target runs in {target.dtype}, the data spec says {spec.dtype}")
    shards = plan(sources)
    manifest = open_store(data_dir, spec, shards)
    write_json_atomic(data_dir / MANIFEST, manifest)
    todo = [s for s in shards if s.name not in manifest["shards"]]
    log(f"[data] {len(shards) - len(todo)} of {len(shards)} shards already made; {len(todo)} to go")
    docs: dict[tuple[str, str], Documents] = {}
    t0 = time.time()
    for n, shard in enumerate(todo):
        # a shard is not started where the manifest's shards of its kind say it would not end in time
        past = [m["seconds"] for m in manifest["shards"].values() if m["kind"] == shard.kind]
        expected = sum(past) / len(past) if past else 0.0
        if time_limit is not None and time.time() - t0 + expected >= time_limit:
            log(f"[data] time limit reached: {len(todo) - n} shards left for the next run")
            break
        d = docs.setdefault((shard.source, shard.split), Documents(tokenizer, shard.source, shard.split))
        t = time.time()
        data = compute_shard(target, shard, shard_windows(shard, d, spec), spec, batch)
        save_atomic(data_dir / f"{shard.name}.pt", data)
        manifest["shards"][shard.name] = {**asdict(shard), "positions": int(data["ids"].numel()),
                                          "seconds": round(time.time() - t, 1)}
        write_json_atomic(data_dir / MANIFEST, manifest)
        log(f"[data] {shard.name}: {shard.windows} windows in {time.time() - t:.0f} s")
    return manifest


class ShardedData:
    """The finished shards of one split (memory-mapped), as one set of rows (windows)."""

    def __init__(self, data_dir: Path, split: str, sources: set[str] | None = None) -> None:
        manifest = read_manifest(Path(data_dir))
        if manifest is None:
            raise FileNotFoundError(f"{data_dir} has no {MANIFEST}: make the data first (build_scripts/eagle3_data.py)")
        self.names = [n for n, s in sorted(manifest["shards"].items())
                      if s["split"] == split and (sources is None or s["source"] in sources)]
        if not self.names:
            raise ValueError(f"{data_dir} holds no {split} shards" + (f" of {sorted(sources)}" if sources else ""))
        self.parts = [torch.load(Path(data_dir) / f"{n}.pt", mmap=True, weights_only=True) for n in self.names]
        counts = torch.tensor([p["ids"].shape[0] for p in self.parts])
        self.starts = torch.cumsum(counts, 0) - counts
        self.ids = torch.cat([p["ids"] for p in self.parts]).long()

    def __len__(self) -> int:
        return self.ids.shape[0]

    def take(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids, features, last hidden, top-1) of these rows, in their order."""
        part = torch.searchsorted(self.starts, rows, right=True) - 1
        out = [[], [], []]
        for r, p in zip(rows.tolist(), part.tolist()):
            j = r - int(self.starts[p])
            for k, key in enumerate(("features", "last_hidden", "top1")):
                out[k].append(self.parts[p][key][j])
        feats, lasts, tops = (torch.stack(x) for x in out)
        return self.ids[rows], feats, lasts, tops.long()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="target model: HF directory or .gguf")
    ap.add_argument("--data", required=True, help="the data directory (made or resumed)")
    ap.add_argument("--source", action="append", default=None,
                    help="NAME[:KIND]=N training windows (repeatable; default: stdlib=256)")
    ap.add_argument("--length", type=int, default=96, help="tokens per window")
    ap.add_argument("--prompt-len", type=int, default=48, help="kept tokens of a window the target continues")
    ap.add_argument("--dtype", default="auto", help="float32, bfloat16 or auto (the runtime's choice)")
    ap.add_argument("--batch", type=int, default=16, help="windows per target forward")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-limit", type=float, default=None, help="stop starting shards after this many minutes")
    args = ap.parse_args(argv)
    try:
        sources = parse_sources(args.source or ["stdlib=256"])
        if args.batch < 1:
            raise ValueError(f"--batch must be >= 1, got {args.batch}")
        if args.length < 3:
            raise ValueError(f"--length must be >= 3, got {args.length}")
        if not 2 <= args.prompt_len < args.length:
            raise ValueError(f"--prompt-len must be in [2, --length={args.length}), got {args.prompt_len}")
        if args.dtype not in ("float32", "bfloat16", "auto"):
            raise ValueError(f"--dtype must be float32, bfloat16 or auto, got {args.dtype!r}")
        if args.time_limit is not None and not args.time_limit > 0:
            raise ValueError(f"--time-limit must be a number of minutes > 0, got {args.time_limit}")
        if not Path(args.target).exists():
            raise ValueError(f"--target {args.target}: no such model directory or .gguf file")
        if Path(args.data).exists() and not Path(args.data).is_dir():
            raise ValueError(f"--data {args.data} is a file: give a directory (new, or one this script made)")
    except ValueError as e:
        ap.error(str(e))
    from echo_trtllm.models.loader import load_model

    target, tok = load_model(args.target, dtype=args.dtype)
    spec = DataSpec(Path(args.target).name, args.length, args.prompt_len, str(target.dtype).removeprefix("torch."),
                    args.seed)
    try:
        build(target, tok, Path(args.data), spec, sources, args.batch,
              None if args.time_limit is None else args.time_limit * 60)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
