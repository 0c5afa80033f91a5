"""The suite's tiers (docs/testing.md), kept honest here rather than by convention:

- ``gpu`` tests are skipped, with the reason, where CUDA is absent;
- a test that starts Python processes (``run_distributed``, the launchers, ``python -m ...``, pip) must be marked
  ``distributed``: while an unmarked test (its fixtures included, of any scope) sets up, runs or tears down,
  starting one from the project's code (tests/, moe_plugin/) fails it, so ``bash scripts/test.sh --fast``
  (``-m "not distributed and not slow"``) launches nothing. What a library starts for itself (W&B's
  ``wandb-core``, inductor's compile checks) is not a process of the test's.
"""

import os
import subprocess
import sys
import sysconfig

import pytest
import torch

_popen_init = subprocess.Popen.__init__
_running = {"test": None}  # the nodeid of an unmarked test in setup/call/teardown, else None


_VENV_BIN = os.path.dirname(sys.executable)  # python, deepspeed, torchrun, pip, moe-plugin


def _starts_python(args) -> bool:
    program = str(args if isinstance(args, (str, bytes, os.PathLike)) else args[0])
    program = program.split()[0] if isinstance(args, str) else program
    return os.path.basename(program).startswith("python") or os.path.dirname(program) == _VENV_BIN


_LIBRARIES = tuple({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})


def _started_by_a_library() -> bool:
    """True when the nearest caller outside the standard library is an installed package (site-packages)."""
    stdlib = os.path.dirname(os.__file__)
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_LIBRARIES):
            return True
        if not path.startswith(stdlib) and path != __file__:
            return False
        frame = frame.f_back
    return False


def _guarded_popen_init(self, args, *rest, **kwargs):
    test = _running["test"]
    if test is not None and _starts_python(args) and not _started_by_a_library():
        raise AssertionError(
            f"{test} starts a process ({args!r}) but is not marked distributed: add @pytest.mark.distributed "
            "(or the module's pytestmark) so the fast tier leaves it out (docs/testing.md)"
        )
    _popen_init(self, args, *rest, **kwargs)


def pytest_configure(config):
    subprocess.Popen.__init__ = _guarded_popen_init


def pytest_unconfigure(config):
    subprocess.Popen.__init__ = _popen_init


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (marked gpu); benchmarks/gpu_check.py runs these on a GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _running["test"] = None if item.get_closest_marker("distributed") else item.nodeid
    try:
        return (yield)
    finally:
        _running["test"] = None
