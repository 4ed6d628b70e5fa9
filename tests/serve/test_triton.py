"""The engine behind a real Triton Inference Server: pytriton's bundled tritonserver (`serve --triton`) and a
standalone tritonserver on a model repository from `triton-repo`, driven by the official `tritonclient` (gRPC
streaming) and Triton's HTTP generate extension, with tensorrtllm_backend's ensemble tensors. References: the
`LLM` API on the same models, and plain AR decoding of each prompt alone for the load test."""

import json
import os
import queue
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pytriton")
grpcclient = pytest.importorskip("tritonclient.grpc")

from echo_trtllm import SamplingParams  # noqa: E402
from echo_trtllm.serve.triton import TritonServing, free_port  # noqa: E402

from .conftest import MAX_TOKENS, N_DISCONNECT, N_STREAMS, child_pids, engine_idle, sigterm_ends_with  # noqa: E402

MODEL = "ensemble"


@pytest.fixture(scope="module")
def triton(pair_llm):
    llm = pair_llm(max_batch_size=32, max_seq_len=256, fallback=False)
    with TritonServing(llm) as serving:  # (run() on entry, stop() on exit)
        yield serving
    llm.shutdown()


def _generate(port: int, body: dict, stream: bool = False):
    url = f"http://127.0.0.1:{port}/v2/models/{MODEL}/generate" + ("_stream" if stream else "")
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        raw = r.read().decode()
    if not stream:
        return json.loads(raw)
    return [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]


def _inputs(prompt: str, max_tokens: int, stream: bool = True, **extra):
    """Tensors as tensorrtllm_backend's end-to-end client sends them: batch dimension first, [[value]]."""
    values = {"text_input": np.array([[prompt.encode()]], dtype=object),
              "max_tokens": np.array([[max_tokens]], dtype=np.int32),
              "stream": np.array([[stream]], dtype=bool), **extra}
    out = []
    for name, arr in values.items():
        dtype = {np.dtype(object): "BYTES", np.dtype(np.int32): "INT32", np.dtype(bool): "BOOL",
                 np.dtype(np.float32): "FP32", np.dtype(np.uint64): "UINT64"}[arr.dtype]
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


class StreamCollector:
    """One gRPC stream carrying many requests; collects each request's text and final flag."""

    def __init__(self, port: int) -> None:
        self.client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        self.texts: dict[str, str] = {}
        self.events: dict[str, int] = {}
        self.final: set[str] = set()
        self.errors: dict[str, str] = {}
        self.stats: dict[str, dict] = {}
        self.done = threading.Condition()
        self.client.start_stream(callback=self._on)

    def _on(self, result, error) -> None:
        with self.done:
            if error is not None:
                rid = getattr(error, "request_id", lambda: None)() if hasattr(error, "request_id") else None
                self.errors[str(rid)] = str(error)
                self.final.add(str(rid))
            else:
                resp = result.get_response()
                rid = resp.id
                text = result.as_numpy("text_output")
                if text is not None:
                    self.texts[rid] = self.texts.get(rid, "") + b"".join(text.reshape(-1)).decode()
                    self.events[rid] = self.events.get(rid, 0) + 1
                    self.stats[rid] = {k: float(result.as_numpy(k).reshape(-1)[0]) for k in (
                        "num_output_tokens", "total_draft_tokens", "total_accepted_draft_tokens")}
                if resp.parameters["triton_final_response"].bool_param:
                    self.final.add(rid)
            self.done.notify_all()

    def send(self, rid: str, prompt: str, max_tokens: int, **extra) -> None:
        self.client.async_stream_infer(MODEL, _inputs(prompt, max_tokens, **extra), request_id=rid,
                                       enable_empty_final_response=True)

    def wait(self, ids, timeout: float = 600) -> bool:
        with self.done:
            return self.done.wait_for(lambda: set(ids) <= self.final, timeout)

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def _idle(llm, timeout: float = 60) -> bool:
    return engine_idle(llm, timeout)


def test_http_generate_equals_llm_api(triton):
    prompt = "ROMEO:\nBut soft, what light"
    ref = triton.llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
    got = _generate(triton.http_port, {"text_input": prompt, "max_tokens": 16, "temperature": 0.0})
    assert got["text_output"] == prompt + ref.text  # TensorRT-LLM's default: the prompt comes first
    assert got["num_output_tokens"] == len(ref.token_ids) and got["num_input_tokens"] == len(ref.prompt_token_ids)
    assert 0 <= got["total_accepted_draft_tokens"] <= got["total_draft_tokens"]
    got = _generate(triton.http_port, {"text_input": prompt, "max_tokens": 16, "temperature": 0.0,
                                       "exclude_input_in_output": True})
    assert got["text_output"] == ref.text
    chunks = _generate(triton.http_port, {"text_input": prompt, "max_tokens": 16, "temperature": 0.0,
                                          "stream": True}, stream=True)
    assert len(chunks) > 2 and "".join(c["text_output"] for c in chunks) == ref.text


def test_sampling_and_stop_words_reach_the_engine(triton):
    prompt = "HAMLET:\n"
    params = dict(max_tokens=24, temperature=0.8, top_p=0.9, top_k=20, seed=77, stop=["\n\n"])
    ref = triton.llm.generate(prompt, SamplingParams(**params), use_tqdm=False)
    got = _generate(triton.http_port, {"text_input": prompt, "max_tokens": 24, "temperature": 0.8, "top_p": 0.9,
                                       "top_k": 20, "random_seed": 77, "stop_words": ["\n\n"],
                                       "bad_words": "", "exclude_input_in_output": True})
    assert got["text_output"] == ref.text


def test_grpc_stream_equals_llm_api(triton):
    c = StreamCollector(triton.grpc_port)
    try:
        prompts = {"a": "def main():\n    ", "b": "To be, or not to be"}
        for rid, p in prompts.items():  # seeded sampling at the default temperature (1.0)
            c.send(rid, p, 20, random_seed=np.array([[5]], dtype=np.uint64))
        assert c.wait(prompts)
        for rid, p in prompts.items():
            ref = triton.llm.generate(p, SamplingParams(max_tokens=20, temperature=1.0, seed=5), use_tqdm=False)
            assert c.texts[rid] == ref.text
        # greedy through the stream, explicitly
        c.send("g", prompts["a"], 20, temperature=np.array([[0.0]], dtype=np.float32))
        assert c.wait(["g"])
        greedy = triton.llm.generate(prompts["a"], SamplingParams(max_tokens=20, temperature=0), use_tqdm=False)
        assert c.texts["g"] == greedy.text and c.events["g"] > 2
        assert c.stats["g"]["num_output_tokens"] == len(greedy.token_ids)
    finally:
        c.close()


def test_256_concurrent_grpc_streams_equal_single_request_ar(triton, load_prompts, ar_single):
    c = StreamCollector(triton.grpc_port)
    try:
        ids = [str(i) for i in range(N_STREAMS)]
        for i, rid in enumerate(ids):
            c.send(rid, load_prompts[i], MAX_TOKENS, temperature=np.array([[0.0]], dtype=np.float32))
        assert c.wait(ids), f"{len(c.final)} of {N_STREAMS} streams ended"
        assert not c.errors, list(c.errors.items())[:3]
        assert sorted(c.texts, key=int) == ids, "a stream was lost"
        for i, rid in enumerate(ids):
            assert c.texts[rid] == ar_single[i].text, f"stream {i} differs from its single-request AR reference"
    finally:
        c.close()
    assert _idle(triton.llm)


def test_32_of_256_streams_cancelled_midway_free_their_slots(triton, load_prompts, ar_single):
    leaving = StreamCollector(triton.grpc_port)
    staying = StreamCollector(triton.grpc_port)
    try:
        for i in range(N_DISCONNECT):
            leaving.send(f"x{i}", load_prompts[i], 200, temperature=np.array([[0.0]], dtype=np.float32))
        for i in range(N_DISCONNECT, N_STREAMS):
            staying.send(str(i), load_prompts[i], MAX_TOKENS, temperature=np.array([[0.0]], dtype=np.float32))
        deadline = time.monotonic() + 60
        while len(leaving.texts) < N_DISCONNECT // 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        leaving.close(cancel=True)  # the clients go away mid-stream
        assert staying.wait([str(i) for i in range(N_DISCONNECT, N_STREAMS)])
        for i in range(N_DISCONNECT, N_STREAMS):
            assert staying.texts[str(i)] == ar_single[i].text
    finally:
        staying.close()
    assert _idle(triton.llm, timeout=120), "a slot leaked after clients cancelled"


BAD = [
    ("no text_input", {"max_tokens": 4}, "text_input"),
    ("empty text_input", {"text_input": "", "max_tokens": 4}, "text_input"),
    ("no max_tokens", {"text_input": "x"}, "max_tokens"),
    ("max_tokens zero", {"text_input": "x", "max_tokens": 0}, "max_tokens"),
    ("max_tokens beyond the context", {"text_input": "x", "max_tokens": 100000}, "max_tokens"),
    ("prompt + max_tokens beyond the context", {"text_input": "a " * 60, "max_tokens": 250}, "max_tokens"),
    ("negative temperature", {"text_input": "x", "max_tokens": 4, "temperature": -1.0}, "temperature"),
    ("top_p zero", {"text_input": "x", "max_tokens": 4, "top_p": 0.0}, "top_p"),
    ("beam search", {"text_input": "x", "max_tokens": 4, "beam_width": 2}, "beam_width"),
    ("bad_words given", {"text_input": "x", "max_tokens": 4, "bad_words": ["a"]}, "bad_words"),
]


@pytest.mark.parametrize("case,body,field", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_get_an_error_naming_the_tensor(triton, case, body, field):
    with pytest.raises(urllib.error.HTTPError) as e:
        _generate(triton.http_port, body)
    assert 400 <= e.value.code < 500, case
    assert field in e.value.read().decode(), case


def test_still_serving_after_bad_inputs(triton):
    for _, body, _ in BAD:
        try:
            _generate(triton.http_port, body)
        except urllib.error.HTTPError:
            pass
    got = _generate(triton.http_port, {"text_input": "O", "max_tokens": 4, "temperature": 0.0})
    assert got["num_output_tokens"] >= 1
    assert _idle(triton.llm)


# ------------------------------------------------------------------------ standalone tritonserver + triton-repo

def _standalone_backend(tmp: Path) -> tuple[Path, Path, dict]:
    """The tritonserver and Python backend that nvidia-pytriton bundles, laid out as a Triton image has them."""
    import pytriton

    root = Path(pytriton.__file__).parent / "tritonserver"
    backend = tmp / "backends" / "python"
    backend.mkdir(parents=True)
    for f in ("libtriton_python.so", "triton_python_backend_utils.py"):
        shutil.copy(root / "backends" / "python" / f, backend / f)
    stub = root / "python_backend_stubs" / f"{sys.version_info.major}.{sys.version_info.minor}" / \
        "triton_python_backend_stub"
    shutil.copy(stub, backend / "triton_python_backend_stub")
    libs = [sysconfig.get_config_var("LIBDIR"), str(Path(pytriton.__file__).parent.parent / "nvidia_pytriton.libs")]
    env = dict(os.environ, LD_LIBRARY_PATH=":".join(libs + [os.environ.get("LD_LIBRARY_PATH", "")]))
    return root / "bin" / "tritonserver", tmp / "backends", env


def test_triton_repo_serves_on_a_standalone_tritonserver(tmp_path, pair_llm):
    from echo_trtllm.serve.triton_repo import write_model_repository

    repo = tmp_path / "repo"
    write_model_repository(repo, None, max_batch_size=8, max_seq_len=256)
    with pytest.raises(FileExistsError):
        write_model_repository(repo, None)
    binary, backends, env = _standalone_backend(tmp_path)
    http, grpc_port, metrics = free_port(), free_port(), free_port()
    proc = subprocess.Popen([str(binary), "--model-repository", str(repo), "--backend-directory", str(backends),
                             "--http-port", str(http), "--grpc-port", str(grpc_port), "--metrics-port", str(metrics),
                             "--log-verbose", "0"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    log: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [log.put(line) for line in proc.stdout], daemon=True).start()
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/models/{MODEL}/ready", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                lines = []
                while not log.empty():
                    lines.append(log.get())
                pytest.fail("tritonserver did not become ready:\n" + "".join(lines))
            time.sleep(0.5)
        prompt = "KING LEAR:\nBlow, winds"
        with pair_llm(max_batch_size=1) as llm:
            ref = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
        got = _generate(http, {"text_input": prompt, "max_tokens": 12, "temperature": 0.0})
        assert got["text_output"] == prompt + ref.text
        c = StreamCollector(grpc_port)
        try:
            c.send("s", prompt, 12, temperature=np.array([[0.0]], dtype=np.float32))
            assert c.wait(["s"], timeout=120)
            assert c.texts["s"] == ref.text
        finally:
            c.close()
        with pytest.raises(urllib.error.HTTPError) as e:
            _generate(http, {"text_input": prompt, "max_tokens": 0})
        assert "max_tokens" in e.value.read().decode()
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_tritonclient_http_sees_tensorrtllm_backend_interface(triton):
    """tritonclient's HTTP client: health and metadata name the ensemble's tensors. Its `infer` cannot reach a
    decoupled model (Triton refuses /infer for them; HTTP clients use the generate extension above), and says so."""
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    c = httpclient.InferenceServerClient(f"127.0.0.1:{triton.http_port}")
    try:
        assert c.is_server_ready() and c.is_model_ready(MODEL)
        meta = c.get_model_metadata(MODEL)
        names = {t["name"]: t["datatype"] for t in meta["inputs"]}
        assert names["text_input"] == "BYTES" and names["max_tokens"] == "INT32" and names["stream"] == "BOOL"
        assert {"temperature", "top_p", "top_k", "random_seed", "stop_words", "bad_words"} <= set(names)
        outs = {t["name"] for t in meta["outputs"]}
        assert {"text_output", "total_draft_tokens", "total_accepted_draft_tokens", "acceptance_rate"} <= outs
        t = httpclient.InferInput("text_input", [1, 1], "BYTES")
        t.set_data_from_numpy(np.array([[b"x"]], dtype=object))
        m = httpclient.InferInput("max_tokens", [1, 1], "INT32")
        m.set_data_from_numpy(np.array([[2]], dtype=np.int32))
        with pytest.raises(InferenceServerException, match="decoupled"):
            c.infer(MODEL, [t, m])
    finally:
        c.close()


def test_sigterm_ends_serve_triton_with_its_tritonserver():
    """`echo-trtllm serve --triton` on SIGTERM stops its tritonserver before it exits (it used to leave it running,
    reparented, for 30-45 s with its shared memory)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "echo_trtllm.cli", "serve", "--triton", "--port", "0",
                             "--dtype", "float32", "--max-batch-size", "2", "--max-seq-len", "128"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 240
        line, seen = "", []
        while "listening on" not in line and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
            seen.append(line)
        if "listening on" not in line and proc.poll() is not None:
            seen.append(proc.stdout.read())  # what it printed before it exited
        assert "listening on" in line, (f"serve --triton did not start (exit code {proc.poll()}, "
                                        f"{time.monotonic() - deadline + 240:.0f} s); its output:\n" + "".join(seen[-40:]))
        servers = [p for p in child_pids(proc.pid, recursive=True)
                   if "tritonserver" in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")]
        assert servers, "no tritonserver child found"
        sigterm_ends_with(proc, servers, (0,), "tritonserver", gone_s=10)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
