"""The engine thread's OpenMP team (echo_trtllm.cpu.release_openmp_threads): the thread that loads the models and
hands them to the engine releases its own team, so one team computes and libgomp keeps its workers spinning."""

import os
import threading
import time

import pytest
import torch

from echo_trtllm import cpu
from echo_trtllm.runtime import engine as engine_mod
from echo_trtllm.runtime.engine import EngineLoop

needs_openmp = pytest.mark.skipif(not cpu._openmp_libraries(), reason="no GNU OpenMP runtime loaded")


def _tasks() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def _until(predicate, seconds: float = 10.0) -> bool:
    end = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


@needs_openmp
def test_release_ends_the_calling_threads_workers_and_a_later_kernel_starts_a_team_again():
    seen: dict = {}

    def body():
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            before = _tasks()
            torch.ones(4_000_000).sum()  # this thread's team: itself and one worker, started now
            workers = _tasks() - before  # (other threads of the process may come and go: only these are watched)
            seen["workers"] = workers
            seen["released"] = cpu.release_openmp_threads()
            seen["ended"] = _until(lambda: not workers & _tasks())
            x = torch.arange(4_000_000, dtype=torch.float64)
            seen["sum"] = float(x.sum())  # still computes, on a new team
        finally:
            torch.set_num_threads(threads)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen["workers"], "a parallel kernel on a new thread started no OpenMP worker"
    assert seen["released"] is True
    assert seen["ended"], "the calling thread's OpenMP worker did not exit"
    assert seen["sum"] == 4_000_000 * 3_999_999 / 2


def test_release_is_false_without_an_openmp_runtime(monkeypatch):
    monkeypatch.setattr(cpu, "_openmp_libraries", lambda: [])
    assert cpu.release_openmp_threads() is False


def test_the_engine_loop_releases_the_team_of_the_thread_that_builds_it(monkeypatch):
    calls = []
    monkeypatch.setattr(engine_mod, "release_openmp_threads", lambda: calls.append(threading.current_thread()))

    class Idle:
        has_work = False

    loop = EngineLoop(Idle())
    try:
        assert calls == [threading.current_thread()]
        assert loop._thread is not threading.current_thread()
    finally:
        loop.shutdown()
