"""The runtime's control plane on the plugin's host library (echo_trtllm.kernels.backend_for("cpu") == "host"
where it is built): the engine's budget allocation, packing, acceptance estimates and counts and the replay of
drafted levels run there, and what it emits is what the same engine emits on the core's PyTorch reference, and what
plain AR emits (greedy)."""

import pytest
import torch

from echo_trtllm import kernels
from echo_trtllm.api import LLM
from echo_trtllm.core import EchoConfig
from echo_trtllm.runtime.request import SamplingParams


def _generate(default_pair, prompts, policy, calls=None):
    target, draft, tok = default_pair
    llm = LLM(target, draft if policy != "ar" else None, tokenizer=tok, max_batch_size=4, max_seq_len=256,
              speculative_config=EchoConfig(policy=policy, k_max=12), fallback=False)
    try:
        if calls is not None:
            calls["allocator"] = getattr(llm.executor.policy.allocator, "keywords", None)
            calls["reader"] = llm.executor.policy.acceptance.reader
            calls["replays"] = llm.executor.policy.replays_on_host
            calls["selector"] = llm.executor.policy.selector
            calls["counter"] = llm.executor.policy.acceptance.counter
            calls["isotonic"] = llm.executor.policy.acceptance.isotonic
            calls["refitter"] = llm.executor.policy.acceptance.refitter
            calls["tree"] = llm.executor.policy.tree_builder
            calls["selector_tree"] = llm.executor.policy.tree_selector
            calls["resulter"] = llm.executor.policy.draft_resulter
            step_cost = llm.executor.step_cost
            calls["stepper"] = (step_cost.drafting.stepper, step_cost.verification.stepper)
        outs = llm.generate(prompts[:6], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.shutdown()


def test_the_engine_runs_allocation_and_packing_on_the_host_library(host_backend, default_pair, prompts,
                                                                    monkeypatch):
    counted = {"allocate_budget": 0, "pack": 0, "_estimate_host": 0, "_replay_level_host": 0, "_observe_host": 0,
               "_kalman_step_host": 0, "_tree_select_host": 0, "_draft_result_host": 0,
               "_refit_host": 0}
    for name in counted:
        real = getattr(kernels, name)

        def wrapper(*a, _real=real, _name=name, **k):
            if k.get("backend") == "host" or _name.endswith("_host"):
                counted[_name] += 1
            return _real(*a, **k)
        monkeypatch.setattr(kernels, name, wrapper)
    info = {}
    on_host = _generate(default_pair, prompts, "echo", info)
    assert info["allocator"] == {"backend": "host"}
    assert info["reader"] is not None  # the acceptance estimates read on the host library too
    assert info["replays"] and info["selector"] is not None  # and the drafted levels replayed, the tree selected
    assert info["counter"] is not None and info["isotonic"] is not None  # and the acceptance counted and refitted
    assert info["refitter"] is not None  # (without a calibration: the fit, its segments and the gate's grids at once)
    assert info["tree"] is not None and info["selector_tree"] is not None  # and the Super-Tree built and cut there
    assert None not in info["stepper"]  # and the step prices learned there
    assert info["resulter"] is not None  # and the tree, selection, selected tree and packing made in one call
    # the one call replaces the allocation's, the selected tree's and the packing's calls where the library selects
    # (the warm-up's plain steps still pack; a step whose estimates are due a refit takes the separate calls); the
    # estimates are read inside the replay's and the result's calls, and the gate's grids come with the refit
    assert counted["_draft_result_host"] > 0 and counted["_refit_host"] > 0, counted
    unused = ("allocate_budget", "_tree_select_host", "_estimate_host")
    assert all(n > 0 for k, n in counted.items() if k not in unused), counted
    monkeypatch.setenv("ECHO_PLUGIN_HOST_LIB", "/nonexistent/libecho_host.so")
    monkeypatch.setattr(kernels, "BUILD_DIR", kernels.BUILD_DIR / "nonexistent")
    kernels.load_library.cache_clear()
    try:
        assert kernels.backend_for("cpu") == "torch"
        info = {}
        on_torch = _generate(default_pair, prompts, "echo", info)
        assert info["allocator"] is None  # the core's own function
        assert info["reader"] is None  # the estimates read with NumPy
        assert not info["replays"] and info["selector"] is None  # the levels replayed, the tree selected in torch
        assert info["counter"] is None and info["isotonic"] is None and info["tree"] is None
        assert info["refitter"] is None
        assert info["stepper"] == (None, None) and info["selector_tree"] is None and info["resulter"] is None
        plain = _generate(default_pair, prompts, "ar")
    finally:
        kernels.load_library.cache_clear()
    assert on_host == on_torch == plain


@pytest.mark.parametrize("content", ["garbage", "abi99"])
def test_an_unusable_or_other_version_library_is_not_loaded(tmp_path, monkeypatch, content):
    """A file that does not load, or a build of another ABI version (plugins/build/ is not versioned), leaves the
    runtime on the core's reference instead of failing to start or calling mismatched entry points."""
    import shutil
    import subprocess

    path = tmp_path / "libecho_host.so"
    if content == "garbage":
        path.write_bytes(b"not a shared object")
    else:
        src = tmp_path / "abi.cpp"
        src.write_text('extern "C" int echo_abi_version(void) { return 99; }\n')
        cxx = shutil.which("g++") or shutil.which("c++")
        subprocess.run([cxx, "-shared", "-fPIC", str(src), "-o", str(path)], check=True)
    monkeypatch.setenv("ECHO_PLUGIN_HOST_LIB", str(path))
    kernels.load_library.cache_clear()
    try:
        assert kernels.load_library("host") is None
        assert kernels.backend_for("cpu") == "torch"
        from echo_trtllm.core.budget import allocate_budget

        assert kernels.host_allocator() is allocate_budget
    finally:
        kernels.load_library.cache_clear()
