"""The `trtllm-build` command lines for an exported pair (written against TensorRT-LLM 1.2.x; not run here).

`echo-trtllm export --format trtllm` writes OUTPUT/trtllm_build.sh from `build_script`: one `trtllm-build` for the
draft (a plain engine) and one for the target with the speculative-decoding flags ECHO needs. What is derived from
the EchoConfig:

    --speculative_decoding_mode draft_tokens_external   the target verifies drafts it is handed (the mode for a
                                                        separate draft model)
    --max_draft_len  max_nodes_per_request - 1           the most draft tokens one request can put in a step
    --max_num_tokens max(k_max, max_batch_size) + ...    room for the whole Super-Tree of a step

TensorRT-LLM 1.2's `trtllm-build` has no flag to load a third-party plugin library; the script loads the ECHO
plugin (libecho_plugin.so, plugins/) into the process with ctypes (RTLD_GLOBAL, so TensorRT's plugin registry sees
its creators) and then runs `tensorrt_llm.commands.build.main()`, the same entry point the `trtllm-build` console
script calls. 1.2's plan accepts only linear drafts at run time (docs/trtllm.md says what of ECHO survives there).
"""

from __future__ import annotations

import shlex

from echo_trtllm.core.config import EchoConfig

__all__ = ["TRTLLM_VERSION", "build_args", "build_script"]

TRTLLM_VERSION = "1.2"  # the last TensorRT-LLM line with trtllm-build and the TensorRT engine backend


def build_args(checkpoint_dir: str, output_dir: str, config: EchoConfig | None, max_batch_size: int,
               max_input_len: int, max_seq_len: int, dtype: str = "bfloat16", fp8: bool = False) -> list[str]:
    """trtllm-build's arguments for one model; `config` None builds a plain (draft) engine."""
    args = ["--checkpoint_dir", checkpoint_dir, "--output_dir", output_dir,
            "--max_batch_size", str(max_batch_size), "--max_input_len", str(max_input_len),
            "--max_seq_len", str(max_seq_len), "--gpt_attention_plugin", dtype, "--remove_input_padding", "enable",
            "--kv_cache_type", "paged", "--use_paged_context_fmha", "enable"]
    if fp8:
        args += ["--use_fp8_context_fmha", "enable"]
    else:
        args += ["--gemm_plugin", dtype]
    if config is not None:
        draft_len = config.max_nodes_per_request - 1
        tokens = max(config.k_max, max_batch_size) + max_batch_size * max_input_len // 8
        args += ["--speculative_decoding_mode", "draft_tokens_external", "--max_draft_len", str(draft_len),
                 "--max_num_tokens", str(max(tokens, max_batch_size * (draft_len + 1)))]
    return args


def build_script(config: EchoConfig, plugin_lib: str, max_batch_size: int = 64, max_input_len: int = 2048,
                 max_seq_len: int = 4096, dtype: str = "bfloat16", fp8: bool = False, has_draft: bool = True) -> str:
    """A bash script that builds ./engine/{draft,target} from ./target and ./draft (paths relative to the script)."""
    def call(args: list[str]) -> str:
        return ('python -c "import ctypes, sys; ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL); '
                'from tensorrt_llm.commands.build import main; sys.argv = [\'trtllm-build\'] + sys.argv[2:]; main()" '
                f'"$PLUGIN" {" ".join(shlex.quote(a) for a in args)}')

    lines = [
        "#!/usr/bin/env bash",
        f"# Written by echo-trtllm export against TensorRT-LLM {TRTLLM_VERSION}.x (pip install 'tensorrt_llm~={TRTLLM_VERSION}.0');",
        "# NOT RUN by the project (TensorRT-LLM cannot be installed where it is built). docs/trtllm.md.",
        "set -euo pipefail",
        'cd "$(dirname "$0")"',
        f'PLUGIN=${{ECHO_PLUGIN_LIB:-{plugin_lib}}}   # libecho_plugin.so, built from plugins/ with CMake',
        '[ -f "$PLUGIN" ] || { echo "ECHO plugin library not found: $PLUGIN (set ECHO_PLUGIN_LIB)" >&2; exit 1; }',
    ]
    if has_draft:
        lines.append(call(build_args("draft", "engine/draft", None, max_batch_size, max_input_len, max_seq_len, dtype,
                                     fp8)))
    lines.append(call(build_args("target", "engine/target", config, max_batch_size, max_input_len, max_seq_len, dtype,
                                 fp8)))
    return "\n".join(lines) + "\n"
