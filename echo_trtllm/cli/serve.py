"""echo-trtllm serve: an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/models, /health,
/metrics) over the same models and engine options as `generate`. Needs the `serve` extra.

    echo-trtllm serve [--model PATH --draft-model PATH | --engine-dir DIR] [--policy echo] [--host 127.0.0.1]
                      [--port 8000] [--max-batch-size 64] [--max-queue-size 1024]

Sampling is per request (the OpenAI body's fields); SIGINT / SIGTERM stop taking connections, let in-flight requests
finish for up to --drain-timeout seconds, then stop. docs/serving.md.
"""

from __future__ import annotations

import argparse

from . import options

PROG = "echo-trtllm serve"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    options.add_model_options(ap)
    options.add_runtime_options(ap, batch=False, parallel=True, invariant=True, quantize=True)
    options.add_max_batch_size_option(ap)
    options.add_speculation_options(ap)
    options.add_calibration_options(ap)
    options.add_fallback_option(ap)
    g = ap.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0 = any free port)")
    g.add_argument("--served-model-name", help="the model id clients send (default: the model's directory name)")
    g.add_argument("--max-queue-size", type=int, default=1024,
                   help="requests accepted beyond the batch before answering 429 (default: 1024)")
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM (default: 30)")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    g = ap.add_argument_group("Triton Inference Server (--triton; the `triton` extra)")
    g.add_argument("--triton", action="store_true",
                   help="serve through the tritonserver that nvidia-pytriton bundles, with tensorrtllm_backend's "
                        "ensemble tensor names, instead of the OpenAI server")
    g.add_argument("--triton-model-name", default="ensemble", help="the Triton model's name (default: ensemble)")
    g.add_argument("--grpc-port", type=int, help="Triton's gRPC port (default: a free one)")
    g.add_argument("--metrics-port", type=int, help="Triton's metrics port (default: a free one)")
    return ap


def _missing_extra(e: ImportError, extra: str) -> int:
    return options.fail(PROG, f"{e.name} is missing: install the {extra} extra (pip install 'echo-trtllm[{extra}]')")


def _check_ports(args) -> None:
    for flag in ("--port", "--grpc-port", "--metrics-port"):
        port = getattr(args, flag[2:].replace("-", "_"))
        if port is not None and not 0 <= port <= 65535:
            raise ValueError(f"{flag} must be in [0, 65535], got {port}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.triton:
        return _main_triton(args)
    try:
        from echo_trtllm.api import ENGINE_LOST
        from echo_trtllm.serve.openai_server import (OpenAIServer, default_model_name, listen, uvicorn_server,
                                                     watch_engine)
    except ImportError as e:
        return _missing_extra(e, "serve")
    try:
        _check_ports(args)
        if args.max_batch_size is not None and args.max_batch_size < 1:
            raise ValueError(f"--max-batch-size must be >= 1, got {args.max_batch_size}")
        if args.drain_timeout < 0:
            raise ValueError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
        options.apply_threads(args)
        config = options.echo_config(args)
        llm = options.make_llm(args, config, args.max_batch_size)
        name = args.served_model_name or default_model_name(args.model, getattr(args, "engine_dir", None))
        server = OpenAIServer(llm, name, max_queue_size=args.max_queue_size)
    except options.USAGE_ERRORS as e:
        return options.fail(PROG, e)
    try:
        sock = listen(args.host, args.port)
    except OSError as e:
        llm.shutdown()
        return options.fail(PROG, f"cannot listen on {args.host}:{args.port}: {e.strerror}")
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    dtypes = llm.dtype["target"] + (f", draft {llm.dtype['draft']}" if llm.dtype["draft"] else "") + \
        (f" {llm.draft_quantization}" if llm.draft_quantization else "") + \
        (", batch-invariant" if llm.batch_invariant else "")
    print(f"{PROG}: listening on http://{shown}:{port} (model {name!r}, dtype {dtypes})", flush=True)
    userver = uvicorn_server(server, args.host, port, args.drain_timeout, args.log_level)
    watch_engine(server, userver)
    userver.run(sockets=[sock])
    if server.engine_lost:
        options.fail(PROG, f"{ENGINE_LOST}; the server drained and exited")
        return 1
    return 0


def _main_triton(args) -> int:
    try:
        from echo_trtllm.serve.triton import TritonServing, stop_on_sigterm
    except ImportError as e:
        return _missing_extra(e, "triton")
    try:
        _check_ports(args)
        options.apply_threads(args)
        llm = options.make_llm(args, options.echo_config(args), args.max_batch_size)
        serving = TritonServing(llm, args.triton_model_name, args.host, http_port=args.port or None,
                                grpc_port=args.grpc_port, metrics_port=args.metrics_port)
    except ImportError as e:
        return _missing_extra(e, "triton")
    except options.USAGE_ERRORS as e:
        return options.fail(PROG, e)
    try:
        stop_on_sigterm()
        serving.run()
        print(f"{PROG} --triton: listening on http://{args.host}:{serving.http_port} grpc {args.host}:"
              f"{serving.grpc_port} metrics {serving.metrics_port} (model {args.triton_model_name!r})", flush=True)
        lost = serving.serve()
    except KeyboardInterrupt:  # during start-up
        lost = None
    finally:
        serving.stop()  # (after serve's own stop: does nothing; after a failure to start: ends what started)
        llm.shutdown()
    if lost:
        options.fail(PROG, f"{lost}; the server stopped")
        return 1
    return 0
