"""The plugin builds as CI must see it: CMake with nvcc for sm_90a (compile errors fail here), the host test
binary runs, and the library exports the whole C ABI."""

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ABI = ["echo_abi_version", "echo_has_cuda", "echo_last_error", "echo_gate_host", "echo_gate_cuda",
       "echo_allocate_budget_host", "echo_allocate_budget_workspace_bytes", "echo_allocate_budget_cuda",
       "echo_pack_host", "echo_pack_workspace_bytes", "echo_pack_cuda", "echo_acceptance_estimate_host",
       "echo_replay_level_host", "echo_select_host", "echo_acceptance_observe_host",
       "echo_tree_from_levels_host", "echo_isotonic_rows_host", "echo_kalman_step_host",
       "echo_tree_select_host", "echo_accept_greedy_host"]


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    if shutil.which("cmake") is None or shutil.which("nvcc") is None:
        pytest.fail("cmake and nvcc are required: every machine of this project has them (CUDA toolkit 13)")
    out = tmp_path_factory.mktemp("plugin-build")
    configure = subprocess.run(["cmake", "-S", str(ROOT / "plugins"), "-B", str(out), "-DCMAKE_CUDA_ARCHITECTURES=90a"],
                               capture_output=True, text=True)
    assert configure.returncode == 0, configure.stdout + configure.stderr
    build = subprocess.run(["cmake", "--build", str(out), "-j", "2"], capture_output=True, text=True)
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    return out


def test_cuda_library_is_built_for_sm90a(build_dir):
    lib = build_dir / "libecho_plugin.so"
    assert lib.is_file()
    if shutil.which("cuobjdump"):
        elf = subprocess.run(["cuobjdump", "--list-elf", str(lib)], capture_output=True, text=True).stdout
        assert "sm_90a" in elf, elf
    names = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True).stdout
    missing = [f for f in ABI if f" {f}" not in names]
    assert not missing, f"C ABI functions missing from libecho_plugin.so: {missing}"


def test_host_test_binary_passes(build_dir):
    run = subprocess.run([str(build_dir / "echo_host_test")], capture_output=True, text=True)
    assert run.returncode == 0 and "all passed" in run.stdout, run.stdout + run.stderr


def test_host_library_reports_no_cuda(build_dir):
    lib = ctypes.CDLL(str(build_dir / "libecho_host.so"))
    from echo_trtllm.kernels import ABI_VERSION

    assert lib.echo_abi_version() == ABI_VERSION == 2 and lib.echo_has_cuda() == 0


def test_cuda_driver_is_built_and_explains_its_usage(build_dir):
    """The C ABI's CUDA driver (scripts/gpu_check.sh runs it under compute-sanitizer on a GPU) builds in CI."""
    run = subprocess.run([str(build_dir / "echo_cuda_driver")], capture_output=True, text=True)
    assert run.returncode == 2 and "check [--small] | bench" in run.stderr, run.stdout + run.stderr
