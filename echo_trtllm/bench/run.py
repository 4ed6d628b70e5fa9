"""echo-trtllm bench: every method side by side, by batch size, on real prompt sets (the library; the command
line is echo_trtllm/cli/bench.py).

    echo-trtllm bench --methods ar,chain,static,eagle2,ddd,echo,echo-dense,echo-fixed --batch-sizes 1,4,16 \
        --max-tokens 32 --prompt-set humaneval --json results.json --markdown results.md --plot results

Every method runs through the public API: one `LLM` per method, batch size and temperature, built on the same
loaded models, reused across rounds (as a server's engine is: the online prices, acceptance estimates and
speculation controller keep what they learnt).
For each batch size and round, every method runs the same requests (batch_size requests, one per slot, submitted
at once with `LLM.generate`; with `waves` > 1, waves x batch_size requests kept batch_size at a time in flight, so
the batch stays full until the last wave drains, as under a server's sustained load), AR first in even rounds and
last in odd ones (with ar_both_ends, at both ends of every round), so ratios are measured side by side and a drift
of the machine's speed favours no side; each method's ratio to AR is taken per round, and medians over rounds are
reported with their spread (min and max, and every round's ratio in the JSON). Per-step figures come from
`LLM.get_stats()`.

Fairness: every method gets the same models, prompts, warm-up rounds and tree options. The echo family also gets
its cost curve (one measured up front, or the calibration's) and with it the budget rule and the fallback to AR;
the fixed-shape methods (chain, static, eagle2, ddd) speculate every step, as they do in the engines they come
from. The rows say which steps speculated (`speculated_share`).

Metrics per (method, batch size, temperature):
  tokens_per_s        output tokens / decode seconds (steps only; prompt prefill excluded)
  e2e_tokens_per_s    output tokens / wall seconds from submission to the last finish (prefill included)
  mat                 mean accepted tokens per request-step (emitted per step, bonus included; AR = 1)
  verified_per_step   tokens the target verified per step (whole batch)
  acceptance_rate     accepted draft tokens / verified draft tokens
  latency_p50/p99_s   request latency from submission to finish
  control_share       ECHO control (gate + schedule + pack) as a share of decode step time
  draft_share         draft model forwards as a share of decode step time
  speculated_share    share of steps that verified drafted tokens (the controller or the budget rule may choose a
                      plain step)
  drafted_share       share of steps that drafted (a pure row drafts in every step; its budget rule may still
                      verify the roots only)
  mat_vs_oracle       emitted tokens / the hindsight oracle's with the same per-step budget, choosing from every
                      output-path token any method of the cell drafted (T=0; bench.trace); mat_vs_own_oracle:
                      from this method's own drafts only
  speedup_vs_ar       tokens_per_s over AR's in the same rounds (median of the per-round ratios)
  full_batch_*        the steps whose batch held batch_size requests: their share of decode seconds, their
                      tokens/s, and that over AR's full-batch tokens/s in the same round (full_batch_speedup_vs_ar):
                      the rate with every slot busy, apart from the steps of a batch that drains (a closed batch's
                      tail, the last wave's)
  *_min / *_max       spread over rounds of tokens_per_s and speedup_vs_ar
  ar_drift_by_round   with ar_both_ends (AR also at the other end of every round): AR's change over each timed
                      round, (end - start) / start; every other cell's ratios are then to AR's rate interpolated
                      at the cell's midpoint in time (`ar_at_end`)
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from dataclasses import dataclass, field

import torch

from echo_trtllm.api import FALLBACK_MODES, LLM
from echo_trtllm.cpu import cpu_flags, cpu_model
from echo_trtllm.core.config import DEFAULT_STATIC_CHOICES, POLICY_NAMES, EchoConfig
from echo_trtllm.core.policies import POLICIES, make_policy
from echo_trtllm.models.draft import draft_kind
from echo_trtllm.runtime.request import SamplingParams

from .trace import TraceRecorder

__all__ = ["BenchConfig", "run_cell", "bench", "markdown_table", "profile_table", "traffic_profile", "plot",
           "machine_info", "report_meta", "METRICS"]

METRICS = ("tokens_per_s", "e2e_tokens_per_s", "mat", "verified_per_step", "acceptance_rate", "latency_p50_s",
           "latency_p99_s", "control_share", "draft_share", "speculated_share", "drafted_share", "mat_vs_oracle",
           "mat_vs_own_oracle",
           "ar_agreement", "ar_prefix_agreement", "full_batch_time_share", "full_batch_tokens_per_s",
           "full_batch_speedup_vs_ar")
FALLBACK_LABELS = {"on": "+fallback", "off": "pure"}
# AR's own tokens/s spread over rounds, (max - min) / median, above which the table warns that ratios carry noise
AR_SPREAD_WARNING = 0.10
SPREAD = ("tokens_per_s", "speedup_vs_ar")

def on_off(value: str) -> bool:
    """'on' -> True, 'off' -> False (a method's switch option)."""
    if value not in ("on", "off"):
        raise ValueError(value)
    return value == "on"


on_off.accepts = "'on' or 'off'"

# options a --methods entry may set for itself: its tree's shape ("chain:num_draft_tokens=2", "eagle2:total_tokens=16:
# max_depth=4"; static_nodes=N keeps the default static tree's first N - 1 paths, it is listed best paths first) and
# the probe's floor (probe_floor=on|off, `EchoConfig.probe_floor`)
SHAPE_OPTIONS = {"max_depth": int, "top_k": int, "beam_width": int, "total_tokens": int, "num_draft_tokens": int,
                 "max_nodes_per_request": int, "k_max": int, "fixed_threshold": float, "ddd_threshold": float,
                 "static_nodes": int, "probe_floor": on_off}


def split_fallback(spec: str) -> tuple[str, str | None]:
    """A --methods entry without its ':fallback=MODE' option, and that mode (None: the run's --fallback)."""
    parts = spec.split(":")
    modes = [p.partition("=")[2] for p in parts if p.startswith("fallback=")]
    if len(modes) > 1 or (modes and modes[0] not in FALLBACK_MODES):
        raise ValueError(f"methods: {spec!r}: fallback=MODE is given at most once, MODE one of "
                         f"{', '.join(FALLBACK_MODES)}")
    return ":".join(p for p in parts if not p.startswith("fallback=")), (modes[0] if modes else None)


def parse_method(spec: str) -> tuple[str, dict]:
    """'policy[:option=value]...' -> (policy, EchoConfig overrides). ValueError naming the entry and what is
    accepted. A ':fallback=on|off|auto' option runs that entry in that mode only (`split_fallback`)."""
    policy, *options = split_fallback(spec)[0].split(":")
    if policy not in POLICY_NAMES:
        raise ValueError(f"methods: unknown policy {policy!r} in {spec!r}; choose from {', '.join(POLICY_NAMES)}")
    overrides: dict = {}
    for opt in options:
        key, eq, value = opt.partition("=")
        if not eq or key not in SHAPE_OPTIONS or key in overrides:
            raise ValueError(f"methods: {spec!r}: each ':' option is one of {', '.join(SHAPE_OPTIONS)}, fallback "
                             f"given once as option=value, got {opt!r}")
        try:
            overrides[key] = SHAPE_OPTIONS[key](value)
        except ValueError:
            what = getattr(SHAPE_OPTIONS[key], "accepts", f"a {SHAPE_OPTIONS[key].__name__}")
            raise ValueError(f"methods: {spec!r}: {key} takes {what}, got {value!r}") from None
    if "static_nodes" in overrides:
        n = overrides.pop("static_nodes")
        if not 2 <= n <= len(DEFAULT_STATIC_CHOICES) + 1:
            raise ValueError(f"methods: {spec!r}: static_nodes takes 2..{len(DEFAULT_STATIC_CHOICES) + 1} (root "
                             f"included), got {n}")
        overrides["static_choices"] = DEFAULT_STATIC_CHOICES[:n - 1]
    return policy, overrides


@dataclass(frozen=True)
class BenchConfig:
    """What one benchmark run covers. speculation: the tree options every method shares (its policy is replaced
    per method; K_max is raised to the batch size where it is below)."""

    methods: tuple[str, ...] = POLICY_NAMES
    batch_sizes: tuple[int, ...] = (1, 4, 16)
    temperatures: tuple[float, ...] = (0.0,)
    max_tokens: int = 64
    rounds: int = 1
    warmup_rounds: int = 1
    speculation: EchoConfig = field(default_factory=EchoConfig)
    max_seq_len: int = 1024
    # at B = 1, T = 0 also run HF transformers generate(): plain and assisted with these num_assistant_tokens
    hf_assisted: tuple[str, ...] = ()
    # the AR fallback of every drafting method: "auto" (LLM's default: the echo family with a cost model), "on"
    # (every method, "+fallback" rows), "off" ("pure" rows: every step speculates); several modes run each
    # method once per mode
    fallback: tuple[str, ...] = ("auto",)
    # requests per cell and round = waves x batch size, at most batch size in flight: with 1 (one closed batch)
    # the batch drains at the end of every round, and speculation's requests, which finish at different steps,
    # leave a tail of small steps that AR's (all finishing together) does not; with more waves the batch stays
    # full until the last one (a serving engine's sustained load at that concurrency)
    waves: int = 1
    # AR at both ends of every round (one more AR cell a round): each method's ratio is then to AR's rate
    # interpolated at the cell's time between the two, and AR's change within a round is reported (ar_drift):
    # a machine whose speed steps mid-round shows as drift instead of as a speed-up
    ar_both_ends: bool = False

    def __post_init__(self) -> None:
        bad = [m for m in self.methods if split_fallback(m)[0].split(":")[0] not in POLICY_NAMES]
        if bad:
            raise ValueError(f"methods: unknown {bad}; choose from {', '.join(POLICY_NAMES)}")
        if not self.methods or len(set(self.methods)) < len(self.methods):
            raise ValueError(f"methods: distinct entries from {', '.join(POLICY_NAMES)} (each may add "
                             f"':option=value' shape options), got {self.methods or 'none'}")
        for m in self.methods:
            parse_method(m)
        if not self.batch_sizes or any(not isinstance(b, int) or b < 1 for b in self.batch_sizes):
            raise ValueError(f"batch_sizes must be integers >= 1, got {self.batch_sizes}")
        if not self.temperatures or any(not t >= 0 for t in self.temperatures):
            raise ValueError(f"temperatures must be numbers >= 0, got {self.temperatures}")
        for name in ("max_tokens", "rounds", "waves"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.hf_assisted and self.waves > 1:
            raise ValueError("hf_assisted runs one request per round: use it with waves 1")
        if self.warmup_rounds < 0:
            raise ValueError(f"warmup_rounds must be >= 0, got {self.warmup_rounds}")
        if not self.fallback or any(f not in FALLBACK_MODES for f in self.fallback) or len(set(self.fallback)) < len(self.fallback):
            raise ValueError(f"fallback takes distinct modes from {', '.join(FALLBACK_MODES)}, got {self.fallback}")
        bad_n = [n for n in self.hf_assisted if n != "heuristic" and not (n.isdigit() and int(n) >= 1)]
        if bad_n:
            raise ValueError(f"hf_assisted takes 'heuristic' or integers >= 1, got {bad_n}")
        for m in self.methods:
            self.config_for(m, max(self.batch_sizes))  # every method's tree options are valid
        self.runs()  # and their labels distinct

    def config_for(self, method: str, batch_size: int) -> EchoConfig:
        """The tree options of one --methods entry (its own shape options over the shared ones)."""
        policy, overrides = parse_method(method)
        config = dataclasses.replace(self.speculation, policy=policy, **overrides)
        return dataclasses.replace(config, k_max=max(config.k_max, batch_size))

    def runs(self) -> list[tuple[str, str, str]]:
        """(label, method, fallback mode) of every engine a cell runs: AR once (it never drafts), then each
        method once per mode, labelled "echo pure" / "echo +fallback" unless the mode is "auto"."""
        out = [("ar", "ar", "auto")]
        for m in self.methods:
            if parse_method(m)[0] == "ar":
                continue
            shape, own = split_fallback(m)
            for mode in (own,) if own else self.fallback:
                out.append((shape if mode == "auto" else f"{shape} {FALLBACK_LABELS[mode]}", m, mode))
        if len({label for label, _, _ in out}) < len(out):
            raise ValueError(f"methods: two entries run under the same label: {[label for label, _, _ in out]}")
        return out


PERF_ENV_PREFIXES = ("ONEDNN_", "DNNL_", "OMP_", "MKL_", "KMP_")


def machine_info() -> dict:
    """What every benchmark JSON records about the machine it ran on."""
    return {"platform": platform.platform(), "processor": cpu_model(), "cpu_flags": cpu_flags(),
            "cores": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            # settings of the math libraries that change speed (oneDNN's primitive cache, thread pools)
            "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(PERF_ENV_PREFIXES)}}


def report_meta(module: str, argv: list[str] | None, runner: str | None = None) -> dict:
    """What a `python -m <module>` report's JSON records beside its numbers: machine, date, the command. runner: how
    the command starts where it is not `python -m <module>` (a script: "python scripts/NAME.py")."""
    args = argv if argv is not None else sys.argv[1:]
    home = str(Path.home())
    args = [a.replace(home, "~") for a in args]  # a report names no one's home directory
    return {"machine": machine_info(), "date": time.strftime("%Y-%m-%d"),
            "command": " ".join([runner or f"python -m {module}", *args])}


RESULT = "RESULT "  # the line a measurement's child process prints its numbers on (`child_result`)


def print_result(result: dict) -> None:
    """A measurement's child process hands its numbers to the parent (`child_result`)."""
    print(RESULT + json.dumps(result), flush=True)


def child_result(cmd: list[str], env: dict | None = None, cwd: str | Path | None = None) -> dict:
    """Run a measurement's child process (a fresh interpreter per arm and round) and return what it printed with
    `print_result`."""
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, check=True)
    line = next((x for x in run.stdout.splitlines() if x.startswith(RESULT)), None)
    if line is None:
        raise RuntimeError(f"{' '.join(cmd[:2])} printed no result line; its stderr ends: {run.stderr[-2000:]}")
    return json.loads(line[len(RESULT):])


def write_report(path: str | Path, script: str, argv: list[str] | None, **payload) -> None:
    """A `python scripts/<script>.py` measurement's JSON: its payload beside `report_meta`."""
    meta = report_meta(f"scripts.{script}", argv, runner=f"python scripts/{script}.py")
    Path(path).write_text(json.dumps({**payload, **meta}, indent=2) + "\n")


def _percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def _step_totals(reports, batch_size: int, recorder) -> tuple:
    """Over a cell's step reports: steps, verified tokens, steps that verified a draft, steps that drafted, tokens
    and seconds of full-batch steps, decode / control / draft-model seconds (in the order run_cell reads them);
    each report also goes to the trace recorder."""
    steps = verified = speculated = drafted = full_tokens = 0
    decode = control = draft_model = full_seconds = 0.0
    for rep in reports:
        steps += 1
        verified += rep.verified_tokens
        speculated += rep.verified_tokens > rep.batch_size
        drafted += rep.speculated
        decode += rep.timings.total
        control += rep.timings.control
        draft_model += rep.timings.draft_model
        if rep.batch_size == batch_size:
            full_tokens += rep.emitted_tokens
            full_seconds += rep.timings.total
        if recorder is not None:
            recorder.record(rep)
    return steps, verified, speculated, drafted, full_tokens, decode, control, draft_model, full_seconds


def run_cell(llm: LLM, prompts: list[str], batch_size: int, max_tokens: int, temperature: float,
             seed: int = 0, waves: int = 1) -> dict:
    """One method at one batch size: waves x batch_size requests submitted at once to `llm` (whose batch holds
    batch_size: in-flight batching admits the next request as one finishes), run to completion.

    `llm` must keep step reports (iter_stats_max_iterations > 0); the cell reads them with get_stats()."""
    n = waves * batch_size
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=0.95 if temperature else 1.0,
                             seed=seed + i, ignore_eos=True) for i in range(n)]
    cell_prompts = [prompts[(seed + i) % len(prompts)] for i in range(n)]
    llm.get_stats()  # drop anything left from before
    t0 = time.perf_counter()
    outputs = llm.generate(cell_prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    reports = llm.get_stats()
    midpoint = t0 + wall / 2
    policy = llm.executor.policy
    recorder = TraceRecorder(policy.max_tree_nodes - 1, policy.max_depth) if temperature == 0 else None
    steps, verified, speculated, drafted, full_tokens, decode, control, draft_model, full_seconds = \
        _step_totals(reports, batch_size, recorder)
    traffic = traffic_profile(reports)
    tokens = sum(len(o.token_ids) for o in outputs)
    req_steps = sum(o.stats.steps for o in outputs)
    drafts_verified = sum(o.stats.verified_tokens for o in outputs) - req_steps
    latencies = [o.stats.latency for o in outputs]
    row = {
        "tokens": tokens, "steps": steps, "decode_seconds": decode,
        "tokens_per_s": tokens / decode, "e2e_tokens_per_s": tokens / wall,
        "mat": tokens / req_steps, "verified_per_step": verified / steps,
        "acceptance_rate": (tokens - req_steps) / drafts_verified if drafts_verified else 0.0,
        "latency_p50_s": _percentile(latencies, 0.5), "latency_p99_s": _percentile(latencies, 0.99),
        "control_share": control / decode, "draft_share": draft_model / decode, "speculated_share": speculated / steps,
        "drafted_share": drafted / steps,
        "mat_vs_oracle": float("nan"), "trace": None,
        "ar_agreement": float("nan"), "ar_prefix_agreement": float("nan"),
        "token_ids": [o.token_ids for o in outputs], "traffic": traffic,
        "full_batch_time_share": full_seconds / decode,
        "full_batch_tokens_per_s": full_tokens / full_seconds if full_seconds else float("nan"),
        "midpoint": midpoint,
    }
    if recorder is not None:
        by_id = {o.request_id: o.token_ids for o in outputs}
        ev = recorder.evaluate(by_id)
        row["mat_vs_oracle"] = row["mat_vs_own_oracle"] = ev["mat_vs_own_oracle"]
        row["trace"] = ev["records"]
        # for the wider oracle over every method of the cell (widen_oracles)
        row["_oracle"] = (recorder, by_id, {o.request_id: i for i, o in enumerate(outputs)})
    return row


def widen_oracles(cells: dict[str, dict], reference: str = "ar", depth_keyed: bool = False) -> None:
    """Re-score each traced cell of one round against the wider candidate set: the output-path tokens any method
    of the round drafted, pooled over the requests (slots) whose output equals the reference method's
    (bench.trace, module docstring). Sets mat_vs_oracle; mat_vs_own_oracle keeps the method's own."""
    ref = cells[reference]["token_ids"]
    same = {m: {i for i, (a, b) in enumerate(zip(c["token_ids"], ref)) if a == b} for m, c in cells.items()}
    traced = {m: c["_oracle"] for m, c in cells.items() if c.get("_oracle")}
    own = {m: recorder.reveals(by_id, slot_of, depth_keyed) for m, (recorder, by_id, slot_of) in traced.items()}
    pooled = {k for m, keys in own.items() for k in keys if k[0] in same[m]}
    for m, (recorder, by_id, slot_of) in traced.items():
        mine = {k for k in pooled if k[0] in same[m]} | own[m]
        cells[m]["mat_vs_oracle"] = recorder.evaluate(by_id, mine, slot_of, depth_keyed)["mat_vs_oracle"]


def load_hf_pair(model: str, draft: str, dtype: str):
    """The same target and draft as HF transformers models (for the assisted-generation baseline)."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    def load(path: str):
        p = Path(path)
        kw = {"gguf_file": p.name} if p.suffix == ".gguf" else {}
        return AutoModelForCausalLM.from_pretrained(str(p.parent if kw else p), dtype=getattr(torch, dtype), **kw).eval()

    return load(model), load(draft)


@torch.inference_mode()
def hf_assisted_cell(hf_target, hf_draft, tokenizer, prompts: list[str], max_tokens: int, num_assistant_tokens,
                     seed: int = 0) -> dict:
    """HF transformers generate() at batch size 1, greedy, one prompt: plain (hf_draft None) or assisted with
    `num_assistant_tokens` draft tokens ('heuristic' = transformers' default adaptive schedule)."""
    ids = torch.tensor([tokenizer.encode(prompts[seed % len(prompts)])])
    kw = {}
    if hf_draft is not None:
        cfg = hf_draft.generation_config
        if num_assistant_tokens == "heuristic":
            cfg.num_assistant_tokens, cfg.num_assistant_tokens_schedule = 20, "heuristic"
        else:
            cfg.num_assistant_tokens, cfg.num_assistant_tokens_schedule = int(num_assistant_tokens), "constant"
        kw["assistant_model"] = hf_draft
    t0 = time.perf_counter()
    out = hf_target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, pad_token_id=tokenizer.eos_token_ids[0] if
                             tokenizer.eos_token_ids else 0, **kw)
    seconds = time.perf_counter() - t0
    midpoint = t0 + seconds / 2
    tokens = out.shape[1] - ids.shape[1]
    # generate() reports no per-step statistics: only the timing metrics are known
    return {**dict.fromkeys(METRICS, float("nan")), "tokens": tokens, "steps": float("nan"), "decode_seconds": seconds,
            "tokens_per_s": tokens / seconds, "e2e_tokens_per_s": tokens / seconds, "latency_p50_s": seconds,
            "latency_p99_s": seconds, "trace": None, "midpoint": midpoint}


def make_engine(target, draft, tokenizer, config: EchoConfig, batch_size: int, max_seq_len: int,
                calibration=None, cost_model="auto", fallback: str = "auto", draft_quantization=None) -> LLM:
    """One method's engine through the public API, on already loaded models (fallback: a FALLBACK_MODES mode;
    draft_quantization: LLM's, which switches the loaded draft in place)."""
    room = batch_size * make_policy(config).max_tree_nodes  # a step of full trees for every request
    drafts = POLICIES[config.policy].needs_draft_model
    return LLM(target, draft if drafts else None, tokenizer=tokenizer,
               speculative_config=config, max_batch_size=batch_size, max_seq_len=max_seq_len,
               max_num_tokens=max(2048, room), calibration=calibration, cost_model=cost_model,
               iter_stats_max_iterations=1 << 20, fallback=FALLBACK_MODES[fallback],
               draft_quantization=draft_quantization if drafts else None)


def bench(target, draft, tokenizer, prompts: list[str], cfg: BenchConfig, calibration=None, cost_model="auto",
          progress=None, hf=None) -> tuple[list[dict], dict]:
    """All cells; returns (result rows, traces keyed 'method/B'). calibration / cost_model: as `LLM`'s (they
    reach the echo family only). hf: (target, draft) transformers models for the assisted-generation baseline at
    batch size 1, temperature 0."""
    rows, traces = [], {}
    runs = cfg.runs()  # AR, the ratios' base, runs in every round
    order = [label for label, _, _ in runs]
    method_of = {label: (m, mode) for label, m, mode in runs}
    for b in cfg.batch_sizes:
        for temp in cfg.temperatures:
            engines = {label: make_engine(target, draft, tokenizer, cfg.config_for(m, b), b, cfg.max_seq_len,
                                          calibration, cost_model, mode) for label, m, mode in runs}
            hf_methods = [f"hf-assisted-{n}" for n in cfg.hf_assisted] if hf is not None and b == 1 and temp == 0 else []
            extra = ["hf-ar", *hf_methods] if hf_methods else []
            try:
                samples = _rounds(engines, order, extra, prompts, cfg, b, temp, draft, tokenizer, progress, hf)
            finally:
                for engine in engines.values():
                    engine.shutdown()
            for m in order + extra:
                if m == "ar" and "ar" not in cfg.methods:
                    continue
                method, mode = method_of.get(m, (m, "auto"))
                rows.append(_row(m, method, mode, m in method_of, samples, cfg, b, temp))
                # traces are keyed by policy (what `simulate` replays): the pure run's when there is one; every
                # timed round's records
                cells = samples[m]
                pure_or_only = method == "ar" or mode == "off" or (mode == "auto" and "off" not in cfg.fallback)
                if temp == 0 and pure_or_only and any(c.get("trace") for c in cells):
                    traces[f"{method}/{b}"] = [rec for c in cells for rec in (c.get("trace") or [])]
    return rows, traces


def _rounds(engines, order, extra, prompts, cfg: BenchConfig, b: int, temp: float, draft, tokenizer, progress,
            hf) -> dict[str, list[dict]]:
    """The warm-up and timed rounds of one (batch size, temperature): every method's timed cells, by label."""
    samples: dict[str, list[dict]] = {m: [] for m in order + extra}
    for rnd in range(cfg.warmup_rounds + cfg.rounds):
        round_cells: dict[str, dict] = {}
        # AR first in even rounds, last in odd ones: a drift of the machine's speed within a round
        # then favours neither side of a ratio; with ar_both_ends AR also runs at the other end
        sequence = (order if rnd % 2 == 0 else order[::-1]) + extra
        if cfg.ar_both_ends:
            sequence = ["ar", *[m for m in sequence if m != "ar"], AR_END]
        for m in sequence:
            if m.startswith("hf-"):
                n = m.rsplit("-", 1)[1]
                cell = hf_assisted_cell(hf[0], hf[1] if m != "hf-ar" else None, tokenizer, prompts,
                                        cfg.max_tokens, n, seed=rnd * b)
            else:
                cell = run_cell(engines["ar" if m == AR_END else m], prompts, b, cfg.max_tokens, temp,
                                seed=rnd * b * cfg.waves, waves=cfg.waves)
            if m == AR_END:
                ar_at_end(round_cells, cell)
            else:
                round_cells[m] = cell
                if rnd >= cfg.warmup_rounds:
                    samples[m].append(cell)
            if progress is not None:
                progress(m, b, temp, cell)
        if temp == 0:
            widen_oracles({m: round_cells[m] for m in order}, depth_keyed=draft_kind(draft) == "eagle3")
        for cell in round_cells.values():
            cell.pop("_oracle", None)
    return samples


def _row(m: str, method: str, mode: str, is_run: bool, samples: dict[str, list[dict]], cfg: BenchConfig, b: int,
         temp: float) -> dict:
    """One method's row: its cells' ratios to AR (AR at the cell's time under ar_both_ends), agreement with AR,
    medians with min-max of the metrics."""
    cells = samples[m]
    for cell, ar_cell in zip(cells, samples["ar"]):
        ref = cell.get("ar_reference", ar_cell)  # AR at the cell's time (ar_both_ends), or AR's cell
        cell["speedup_vs_ar"] = cell["tokens_per_s"] / ref["tokens_per_s"]
        base = ref["full_batch_tokens_per_s"]
        cell["full_batch_speedup_vs_ar"] = cell["full_batch_tokens_per_s"] / base if base else float("nan")
        if "token_ids" in cell:  # the same prompts and seeds as AR's cell of that round
            cell["ar_agreement"], cell["ar_prefix_agreement"] = agreement(cell["token_ids"], ar_cell["token_ids"])
    row = {"method": m, "policy": parse_method(method)[0] if is_run else method,
           "shape": method, "fallback": mode, "batch_size": b, "temperature": temp,
           "rounds": len(cells), "speedup_vs_ar_by_round": [c["speedup_vs_ar"] for c in cells]}
    # per-step host <-> device traffic does not depend on the machine's speed: the last round's
    row["traffic"] = cells[-1].get("traffic")
    if cfg.ar_both_ends:  # on every row: AR's own row is left out when "ar" is not in methods
        row["ar_drift_by_round"] = [c["ar_drift"] for c in samples["ar"]]
    for key in (*METRICS, "speedup_vs_ar"):
        vals = [c[key] for c in cells if key in c and c[key] == c[key]]  # drop absent and NaN
        row[key] = statistics.median(vals) if vals else None
        if key in SPREAD:
            row[f"{key}_min"] = min(vals) if vals else None
            row[f"{key}_max"] = max(vals) if vals else None
    return row


AR_END = "ar (end of round)"  # the second AR cell of a round under ar_both_ends


def ar_at_end(round_cells: dict[str, dict], end: dict) -> None:
    """AR's second cell of a round (ar_both_ends): AR's change over the round, (end - start) / start, goes on AR's
    first cell (`ar_drift`), and every other cell of the round gets AR's rates linearly interpolated at its
    midpoint between the two AR cells' midpoints (`ar_reference`): the base of its ratios."""
    start = round_cells["ar"]
    start["ar_drift"] = end["tokens_per_s"] / start["tokens_per_s"] - 1
    span = end["midpoint"] - start["midpoint"]
    for m, cell in round_cells.items():
        if m == "ar":
            continue
        w = min(1.0, max(0.0, (cell["midpoint"] - start["midpoint"]) / span)) if span > 0 else 0.5
        cell["ar_reference"] = {key: (1 - w) * start[key] + w * end[key]
                                for key in ("tokens_per_s", "full_batch_tokens_per_s")}


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> tuple[float, float]:
    """(share of requests whose tokens equal the reference's, mean share of each output that matches the
    reference before the first difference). Lossless methods give (1, 1) in exact arithmetic; bf16 kernels over
    different token counts round differently, so a near-tie can flip a token and the two continuations part."""
    exact, prefix = 0, 0.0
    for out, ref in zip(outputs, reference):
        exact += out == ref
        n = max(len(out), len(ref), 1)
        common = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
        prefix += common / n
    return exact / max(len(outputs), 1), prefix / max(len(outputs), 1)


def traffic_profile(reports) -> dict | None:
    """Host <-> device traffic per step of a cell (runtime.transfer): over all steps and over the speculative
    ones (the steps whose tree is drafted level by level): mean and max syncs, mean bytes each way, the largest
    single read, and per label the reads per step and bytes per read."""
    steps = [r.traffic for r in reports if r.traffic is not None]
    if not steps:
        return None

    def summary(ts):
        if not ts:
            return None
        labels = sorted({k for t in ts for k in t.reads})
        return {"steps": len(ts), "syncs_mean": sum(t.syncs for t in ts) / len(ts),
                "syncs_max": max(t.syncs for t in ts),
                "to_host_bytes_mean": sum(t.to_host_bytes for t in ts) / len(ts),
                "to_device_bytes_mean": sum(t.to_device_bytes for t in ts) / len(ts),
                "largest_read_bytes": max(t.largest_read_bytes for t in ts),
                "reads_per_step": {k: sum(t.reads.get(k, (0, 0))[0] for t in ts) / len(ts) for k in labels},
                "bytes_per_read": {k: sum(t.reads.get(k, (0, 0))[1] for t in ts)
                                   / max(sum(t.reads.get(k, (0, 0))[0] for t in ts), 1) for k in labels}}

    spec = [r.traffic for r in reports if r.traffic is not None and r.speculated]
    return {"all": summary(steps), "speculative": summary(spec)}


def profile_table(rows: list[dict], vocab_size: int) -> str:
    """`bench --profile`: host <-> device traffic per step, speculative steps (all steps where none speculated)."""
    head = ("| method | B | steps | syncs/step (mean, max) | to host / step | to device / step | largest read "
            "| ≥ one vocabulary row? | reads per step |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    row_bytes = 4 * vocab_size  # one float32 row over the vocabulary
    for r in rows:
        t = r.get("traffic") or {}
        s = t.get("speculative") or t.get("all")
        if not s:
            continue
        reads = ", ".join(f"{k} {v:.1f}" for k, v in s["reads_per_step"].items())
        lines.append(f"| {r['method']} | {r['batch_size']} | {s['steps']} | {s['syncs_mean']:.1f}, {s['syncs_max']} | "
                     f"{s['to_host_bytes_mean'] / 1e3:.1f} kB | {s['to_device_bytes_mean'] / 1e3:.1f} kB | "
                     f"{s['largest_read_bytes'] / 1e3:.1f} kB | {'yes' if s['largest_read_bytes'] >= row_bytes else 'no'} "
                     f"| {reads} |")
    return "\n".join(lines) + "\n"


def ar_spread_warnings(rows: list[dict]) -> list[str]:
    """A line per (B, T) cell whose AR tokens/s spread over rounds exceeds AR_SPREAD_WARNING, and (ar_both_ends) a
    line per timed round in which AR's own rate moved by more than that between the round's two ends."""
    out, drifts = [], {}
    for r in rows:
        if r.get("ar_drift_by_round"):
            drifts[(r["batch_size"], r["temperature"])] = r["ar_drift_by_round"]
        if r["method"] == "ar" and r.get("rounds", 1) >= 2 and r.get("tokens_per_s"):
            spread = (r["tokens_per_s_max"] - r["tokens_per_s_min"]) / r["tokens_per_s"]
            if spread > AR_SPREAD_WARNING:
                out.append(f"warning: AR's own tokens/s spread {spread:.0%} over rounds at B={r['batch_size']}, "
                           f"T={r['temperature']:g} (> {AR_SPREAD_WARNING:.0%}): ratios there carry the machine's noise")
    for (b, temp), by_round in drifts.items():
        for i, drift in enumerate(by_round):
            if abs(drift) > AR_SPREAD_WARNING:
                out.append(f"warning: AR's tokens/s moved {drift:+.0%} between the two ends of timed round {i + 1} "
                           f"at B={b}, T={temp:g} (> {AR_SPREAD_WARNING:.0%}): that round's ratios are to AR "
                           "interpolated in time, and carry whatever the machine did in between")
    return out


def markdown_table(rows: list[dict]) -> str:
    head = ("| method | B | T | tokens/s | ×AR | ×AR full batch | MAT | verified/step | accept | p50 s | p99 s | control "
            "| draft | spec steps | MAT/oracle | = AR |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]

    def f(v, fmt):
        return "–" if v is None else format(v, fmt)

    def spread(r):
        lo, hi = r.get("speedup_vs_ar_min"), r.get("speedup_vs_ar_max")
        return "" if r.get("rounds", 1) < 2 or lo is None else f" ({lo:.2f}–{hi:.2f})"

    for r in rows:
        lines.append(
            f"| {r['method']} | {r['batch_size']} | {r['temperature']:g} | {f(r['tokens_per_s'], '.1f')} | "
            f"{f(r['speedup_vs_ar'], '.2f')}{spread(r)} | {f(r.get('full_batch_speedup_vs_ar'), '.2f')} | "
            f"{f(r['mat'], '.2f')} | {f(r['verified_per_step'], '.1f')} | "
            f"{f(r['acceptance_rate'], '.2f')} | {f(r['latency_p50_s'], '.2f')} | {f(r['latency_p99_s'], '.2f')} | "
            f"{f(r['control_share'], '.1%')} | {f(r['draft_share'], '.1%')} | {f(r['speculated_share'], '.0%')} | "
            f"{f(r['mat_vs_oracle'], '.2f')} | {f(r.get('ar_agreement'), '.0%')} |")
    warnings = ar_spread_warnings(rows)
    return "\n".join(lines) + "\n" + "".join(f"\n{w}\n" for w in warnings)


def plot(rows: list[dict], prefix: str, title: str = "") -> list[str]:
    """throughput vs batch size per method, and speedup over AR; one figure pair per temperature."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib (or pip install -e .[bench])") from None
    files = []
    for temp in sorted({r["temperature"] for r in rows}):
        sub = [r for r in rows if r["temperature"] == temp]
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for m in dict.fromkeys(r["method"] for r in sub):
            pts = sorted((r["batch_size"], r["tokens_per_s"], r["speedup_vs_ar"]) for r in sub if r["method"] == m)
            xs = [p[0] for p in pts]
            axes[0].plot(xs, [p[1] for p in pts], marker="o", label=m)
            axes[1].plot(xs, [p[2] for p in pts], marker="o", label=m)
        for ax, ylabel in zip(axes, ("output tokens/s", "speedup over AR")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch size")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        axes[1].axhline(1.0, color="black", lw=0.8)
        axes[0].legend(fontsize=8)
        fig.suptitle(f"{title} (temperature {temp:g})".strip())
        fig.tight_layout()
        name = f"{prefix}-t{temp:g}.png"
        fig.savefig(name, dpi=110)
        plt.close(fig)
        files.append(name)
    return files
