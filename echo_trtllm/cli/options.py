"""Command-line options shared by every echo-trtllm command: one definition per flag, so a flag means the same
thing with the same default wherever it appears. Defaults of the speculation flags are EchoConfig's own; the
sampling flags are SamplingParams' names.

    models       --model --draft-model [--engine-dir]
    runtime      --dtype --device --threads --max-batch-size --max-seq-len
    speculation  --policy --k-max --max-depth --max-nodes-per-request --tree-top-k --beam-width --total-tokens
                 --num-draft-tokens --static-nodes
    sampling     --max-tokens --temperature --top-k --top-p --seed
    calibration  --calibration --no-calibration

`--top-k` is always the sampling top-k; the tree's children per node is `--tree-top-k`.
"""

from __future__ import annotations

import argparse
import sys

from echo_trtllm.api import DEFAULT_MAX_BATCH_SIZE
from echo_trtllm.core.config import POLICY_NAMES, EchoConfig
from echo_trtllm.models.loader import DTYPE_CHOICES
from echo_trtllm.models.tp import TensorParallelError

__all__ = [
    "add_model_options", "add_runtime_options", "add_speculation_options", "add_sampling_options",
    "add_calibration_options", "add_fallback_option", "fallback_modes", "echo_config", "sampling_params",
    "apply_threads", "int_list", "float_list", "fail",
    "make_llm", "add_microbench_options", "microbench_grid", "add_dtype_option", "add_threads_option",
    "add_max_batch_size_option", "add_max_seq_len_option", "add_tree_shape_options", "add_tp_size_option",
    "add_prompt_set_option", "USAGE_ERRORS",
]  # fmt: skip

_DEFAULT = EchoConfig()
DEFAULT_MAX_TOKENS = 64
# what a command turns into exit code 2 with a one-line message (bad input, missing file); anything else is a bug
# a tensor-parallel group that cannot start is reported like a usage error, not with a traceback
USAGE_ERRORS = (ValueError, TypeError, FileNotFoundError, FileExistsError, TensorParallelError)


def fail(prog: str, message: object) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def int_list(text: str, flag: str, minimum: int = 1) -> list[int]:
    """Comma-separated integers >= minimum ("1,4,16"), or ValueError naming the flag."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not values or any(v < minimum for v in values):
        raise ValueError(f"{flag} must list integers >= {minimum}, got {text!r}")
    return values


def float_list(text: str, flag: str, minimum: float = 0.0) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated numbers, got {text!r}") from None
    if not values or any(not v >= minimum for v in values):
        raise ValueError(f"{flag} must list numbers >= {minimum:g}, got {text!r}")
    return values


def add_model_options(ap: argparse.ArgumentParser, engine_dir: bool = True) -> None:
    g = ap.add_argument_group("models")
    g.add_argument("--model", help="target: HF model directory or .gguf file (default: the embedded tiny target)")
    g.add_argument("--draft-model", help="draft: HF model directory or .gguf file, or an EAGLE-3 head directory "
                   "(default with the embedded target: its EAGLE-3 head for generate, serve, build and calibrate, "
                   "with --tp-size > 1 too; the separate tiny draft for the benchmarks and export)")
    if engine_dir:
        g.add_argument("--engine-dir", help="an engine directory built by `echo-trtllm build` (instead of --model)")


def add_tp_size_option(g, what: str) -> None:
    g.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1,
                   help=f"tensor-parallel ranks {what} (default: 1)")


def add_prompt_set_option(g, what: str = "the prompts") -> None:
    from echo_trtllm.bench.prompts import PROMPT_SETS

    g.add_argument("--prompt-set", default="mixed", choices=list(PROMPT_SETS), help=f"{what} (default: mixed)")


def add_dtype_option(g, what: str = "weights and activations") -> None:
    g.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help=f"{what}; auto: bfloat16 on CUDA, on a CPU bfloat16 where it has bf16 matrix instructions and "
                        "the model is large enough to gain, else float32: a rule, the same on every start "
                        "(docs/dtype.md; default: auto)")


def add_threads_option(g, whose: str = "") -> None:
    g.add_argument("--threads", type=int, help=f"torch CPU threads{whose} (default: torch's own)")


def add_max_batch_size_option(g, note: str = "") -> None:
    g.add_argument("--max-batch-size", type=int,
                   help=f"requests in the engine's batch at most{note} (default: LLM's, {DEFAULT_MAX_BATCH_SIZE} or fewer "
                        "where the speculation config cannot run that many)")


def add_max_seq_len_option(g) -> None:
    g.add_argument("--max-seq-len", type=int, default=1024, help="context per request, prompt included (default: 1024)")


def add_runtime_options(ap: argparse.ArgumentParser, batch: bool = True, parallel: bool = False,
                        invariant: bool = False, quantize: bool = False) -> None:
    g = ap.add_argument_group("runtime")
    if parallel:
        add_tp_size_option(g, "for the target and a separate draft model; an EAGLE-3 head runs whole on rank 0 "
                              "(ranks spawned here, or one per process under torchrun; docs/scale-out.md)")
    add_dtype_option(g)
    g.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    add_threads_option(g)
    if batch:
        add_max_batch_size_option(g)
    add_max_seq_len_option(g)
    if invariant:
        g.add_argument("--batch-invariant", action="store_true",
                       help="every request's output the same bits alone, in any batch and under any policy, bfloat16 "
                            "included (slower; docs/performance.md)")
    if quantize:
        g.add_argument("--draft-quantization", choices=["w8a16"], default=None,
                       help="w8a16: the draft's products of one to four rows read int8 weights (half the bytes; a "
                            "bfloat16 draft on the CPU; LLM(draft_quantization=...), docs/performance.md)")


def add_speculation_options(ap: argparse.ArgumentParser, policy: bool = True) -> None:
    g = ap.add_argument_group("speculation (defaults: EchoConfig's; with --engine-dir the engine's EchoConfig)")
    if policy:
        g.add_argument("--policy", default=_DEFAULT.policy, choices=POLICY_NAMES)
    add_tree_shape_options(g)
    g.add_argument("--total-tokens", type=int, default=_DEFAULT.total_tokens,
                   help="eagle2/ddd nodes verified per request, root included")
    g.add_argument("--num-draft-tokens", type=int, default=_DEFAULT.num_draft_tokens, help="chain length")
    g.add_argument("--static-nodes", type=int,
                   help="static: the first N - 1 paths of the default static tree, root included (default: all "
                        f"{len(_DEFAULT.static_choices) + 1})")


def add_tree_shape_options(g) -> None:
    """The echo family's tree shape and budget (EchoConfig's defaults): --k-max --max-depth --max-nodes-per-request
    --tree-top-k --beam-width."""
    g.add_argument("--k-max", type=int, default=_DEFAULT.k_max,
                   help="global verification budget per step, tokens (echo family; upper bound of the budget rule)")
    g.add_argument("--max-depth", type=int, default=_DEFAULT.max_depth, help="deepest draft level")
    g.add_argument("--max-nodes-per-request", type=int, default=_DEFAULT.max_nodes_per_request,
                   help="cap on each request's verified tree, root included (echo family)")
    g.add_argument("--tree-top-k", type=int, default=_DEFAULT.top_k, help="children drafted per expanded node")
    g.add_argument("--beam-width", type=int, default=_DEFAULT.beam_width,
                   help="nodes expanded per request and level (echo family)")


def add_sampling_options(ap: argparse.ArgumentParser, temperature: bool = True) -> None:
    g = ap.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help=f"tokens generated per request at most (default: {DEFAULT_MAX_TOKENS})")
    if temperature:
        g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
        g.add_argument("--top-k", type=int, default=0, help="sampling top-k, 0 = off")
        g.add_argument("--top-p", type=float, default=1.0, help="sampling top-p")
        g.add_argument("--seed", type=int, help="sampling seed (reproducible output)")


def add_calibration_options(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("calibration")
    g.add_argument("--calibration", help="calibration JSON from echo-trtllm calibrate (default: the engine's, else "
                                         "a cost curve measured at load)")
    g.add_argument("--no-cost-model", action="store_true",
                   help="no budget rule and no AR fallback: the fixed --k-max every step (ablations)")


def add_fallback_option(ap: argparse.ArgumentParser, several: bool = False) -> None:
    """--fallback: the AR fallback (LLM(fallback=...)); a command that compares may take several modes."""
    modes = "auto, on, off"
    ap.add_argument("--fallback", default="auto",
                    help=f"the AR fallback: auto (the echo family with a cost model), on (every drafting method), "
                         f"off (pure: every step speculates){'; comma-separated to run each method per mode' if several else ''}"
                         f" ({modes}; default: auto)")


def fallback_modes(value: str, several: bool = False) -> tuple[str, ...]:
    """The --fallback value as modes (ValueError naming the flag and what is accepted)."""
    from echo_trtllm.api import FALLBACK_MODES

    modes = tuple(v for v in value.split(",") if v) if several else (value,)
    bad = [m for m in modes if m not in FALLBACK_MODES]
    if bad or not modes or len(set(modes)) < len(modes):
        raise ValueError(f"--fallback takes {'distinct ' if several else 'one of '}{', '.join(FALLBACK_MODES)}, "
                         f"got {value!r}")
    return modes


def echo_config(args: argparse.Namespace, **override) -> EchoConfig:
    """The EchoConfig the speculation flags describe (ValueError naming the field when one is bad)."""
    fields = dict(policy=getattr(args, "policy", _DEFAULT.policy), k_max=args.k_max, max_depth=args.max_depth,
                  max_nodes_per_request=args.max_nodes_per_request, top_k=args.tree_top_k,
                  beam_width=args.beam_width, total_tokens=args.total_tokens, num_draft_tokens=args.num_draft_tokens)
    nodes = getattr(args, "static_nodes", None)
    if nodes is not None:
        if not 2 <= nodes <= len(_DEFAULT.static_choices) + 1:
            raise ValueError(f"--static-nodes takes 2..{len(_DEFAULT.static_choices) + 1} (root included), got {nodes}")
        fields["static_choices"] = _DEFAULT.static_choices[: nodes - 1]
    fields.update(override)
    return EchoConfig(**fields)


def sampling_params(args: argparse.Namespace, **override):
    from echo_trtllm.runtime.request import SamplingParams

    fields = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                  seed=args.seed)
    fields.update(override)
    return SamplingParams(**fields)


def apply_threads(args: argparse.Namespace) -> None:
    if getattr(args, "threads", None) is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)


def make_llm(args: argparse.Namespace, config: EchoConfig, max_batch_size: int, **kwargs):
    """The LLM the model, runtime and calibration flags describe (the one place commands build engines). With
    --engine-dir the engine's own EchoConfig is used and `config` only validated the flags."""
    from echo_trtllm.api import FALLBACK_MODES, LLM

    engine = getattr(args, "engine_dir", None)
    if engine and (args.model or args.draft_model):
        raise ValueError("--engine-dir names its own models; do not also give --model/--draft-model")
    common = dict(speculative_config=None if engine else config, max_batch_size=max_batch_size, max_seq_len=args.max_seq_len,
                  dtype=args.dtype, device=args.device, calibration=getattr(args, "calibration", None),
                  cost_model=None if getattr(args, "no_cost_model", False) else "auto",
                  fallback=FALLBACK_MODES[fallback_modes(getattr(args, "fallback", "auto"))[0]],
                  tensor_parallel_size=getattr(args, "tp_size", 1),
                  batch_invariant=getattr(args, "batch_invariant", False),
                  draft_quantization=getattr(args, "draft_quantization", None), **kwargs)
    if engine:
        return LLM(engine_dir=engine, **common)
    return LLM(args.model, args.draft_model, **common)


def add_microbench_options(ap: argparse.ArgumentParser, batch_sizes: str, k_max_values: str) -> None:
    """The grid and timing flags of the control-plane microbenchmarks (bench-control, bench-kernels)."""
    g = ap.add_argument_group("grid")
    g.add_argument("--batch-sizes", default=batch_sizes, help=f"comma-separated (default: {batch_sizes})")
    g.add_argument("--k-max-values", default=k_max_values,
                   help=f"global budgets to time, comma-separated (default: {k_max_values})")
    g.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    add_threads_option(g, " (the docs use 1)")
    g.add_argument("--json", help="also write the results here")


def microbench_grid(args: argparse.Namespace) -> tuple[list[int], list[int]]:
    """(batch sizes, K_max values) of the microbenchmark flags; sets the threads."""
    apply_threads(args)
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    return int_list(args.batch_sizes, "--batch-sizes"), int_list(args.k_max_values, "--k-max-values")
