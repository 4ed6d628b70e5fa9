"""Every flag two commands share is defined once (cli/options.py) and means the same everywhere: the same default,
type, choices and action in every command that takes it; and the shared defaults are the Python API's. Each
command's parser is taken from its own main(), stopped where it would parse."""

import argparse
import importlib

import pytest

from echo_trtllm.api import DEFAULT_MAX_BATCH_SIZE, LLM, default_max_batch_size
from echo_trtllm.core import EchoConfig
from echo_trtllm.cli import COMMANDS


class _Parser(Exception):
    def __init__(self, parser):
        self.parser = parser


def _parser_of(module: str) -> argparse.ArgumentParser:
    original = argparse.ArgumentParser.parse_args

    def capture(self, *args, **kwargs):
        raise _Parser(self)

    argparse.ArgumentParser.parse_args = capture
    try:
        importlib.import_module(module).main([])
    except _Parser as p:
        return p.parser
    finally:
        argparse.ArgumentParser.parse_args = original
    raise AssertionError(f"{module}.main did not parse its arguments")


def _definitions() -> dict[str, dict[str, tuple]]:
    """flag -> {command: (default, type, choices, action class)}"""
    flags: dict[str, dict[str, tuple]] = {}
    for name, (module, _) in COMMANDS.items():
        for action in _parser_of(module)._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and flag != "--help":
                    choices = tuple(action.choices) if action.choices is not None else None
                    flags.setdefault(flag, {})[name] = (action.default, action.type, choices, type(action).__name__)
    return flags


# a benchmark's own grid and effort (what it measures, how long), not a property of the engine: each command keeps its
# own default, the help of each says what it is
EXPERIMENT_FLAGS = {"--batch-sizes", "--steps", "--methods", "--num-prompts", "--repeats", "--k-max-values"}


def test_every_shared_flag_has_one_meaning():
    flags = _definitions()
    shared = {f: by_cmd for f, by_cmd in flags.items() if len(by_cmd) > 1 and f not in EXPERIMENT_FLAGS}
    assert {"--dtype", "--max-batch-size", "--max-seq-len", "--threads", "--k-max", "--max-depth"} <= set(shared)
    differ = {f: by_cmd for f, by_cmd in shared.items() if len(set(by_cmd.values())) > 1}
    assert not differ, differ


def test_the_shared_defaults_are_the_python_apis():
    import inspect

    flags = _definitions()
    api = inspect.signature(LLM.__init__).parameters
    assert api["max_batch_size"].default is None  # LLM's own: DEFAULT_MAX_BATCH_SIZE or fewer (default_max_batch_size)
    for flag, param in (("--max-batch-size", "max_batch_size"), ("--dtype", "dtype"), ("--max-seq-len", "max_seq_len")):
        defaults = {d[0] for d in flags[flag].values()}
        assert defaults == {api[param].default}, (flag, defaults)


def test_the_check_sees_a_flag_defined_twice(monkeypatch):
    """The check is not vacuous: a command that defines --max-seq-len with its own default is caught."""
    from echo_trtllm.cli import options

    real = options.add_max_seq_len_option
    calls = []

    def odd(g):
        if calls:
            g.add_argument("--max-seq-len", type=int, default=512)
        else:
            real(g)
        calls.append(g)

    monkeypatch.setattr(options, "add_max_seq_len_option", odd)
    with pytest.raises(AssertionError):
        test_every_shared_flag_has_one_meaning()


def test_the_default_batch_is_64_where_the_config_can_run_it():
    assert default_max_batch_size(EchoConfig(), True, 65, None) == DEFAULT_MAX_BATCH_SIZE
    assert default_max_batch_size(EchoConfig(k_max=32), True, 65, None) == 32  # every root within K_max
    assert default_max_batch_size(EchoConfig(policy="eagle2"), False, 60, None) == 2048 // 60  # full trees fit
    assert default_max_batch_size(EchoConfig(policy="ar"), False, 1, 16) == 16
    # through LLM: a K_max below 64 runs out of the box (it was refused when the default was a fixed 64)
    llm = LLM(speculative_config=EchoConfig(k_max=32), max_seq_len=64)
    try:
        assert llm.max_batch_size == 32
    finally:
        llm.shutdown()
