import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from echo_trtllm import kernels

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def host_backend(tmp_path_factory):
    """Build the plugin's host library from plugins/ with the C++ compiler and point the loader at it
    (ECHO_HOST_CXXFLAGS: more flags, after the defaults: scripts/sanitize_host.sh builds it with the sanitizers)."""
    cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if cxx is None:
        pytest.fail("no C++ compiler found (g++/c++): the plugin host tests need one")
    out = tmp_path_factory.mktemp("plugin") / "libecho_host.so"
    cmd = [cxx, "-std=c++17", "-O2", "-ffp-contract=off", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC",
           *os.environ.get("ECHO_HOST_CXXFLAGS", "").split(),
           f"-I{ROOT / 'plugins' / 'include'}", str(ROOT / "plugins" / "csrc" / "echo_host.cpp"), "-o", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    os.environ["ECHO_PLUGIN_HOST_LIB"] = str(out)
    kernels.load_library.cache_clear()
    yield "host"
    os.environ.pop("ECHO_PLUGIN_HOST_LIB", None)
    kernels.load_library.cache_clear()


@pytest.fixture(params=["host", "cuda"])
def backend(request, host_backend):
    """Each plugin backend: the host build (always), the CUDA library (where a GPU and the build exist)."""
    if request.param == "cuda" and not (torch.cuda.is_available() and kernels.load_library("cuda") is not None):
        pytest.skip("needs a CUDA GPU and plugins/build/libecho_plugin.so (scripts/gpu_check.sh runs these)")
    return request.param
