"""Shared test settings: hypothesis profiles (fewer examples under CI) and hardware markers."""
import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=6, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=25, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
# the larger sweep: CFX_HYPOTHESIS=sweep python -m pytest cfx_tests/test_plan.py (README)
settings.register_profile("sweep", max_examples=200, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("CFX_HYPOTHESIS") or ("ci" if os.environ.get("CI") else "dev"))

if os.environ.get("PYTEST_XDIST_WORKER"):
    # one intra-op thread per worker process (and its subprocesses: torchrun ranks, notebook kernels):
    # the workers already fill the cores, and two processes each spinning a pool per core ran the
    # suite slower than one process (measured: test_train + test_plan 150 s on 2 workers with the
    # default pools, 75 s with one thread each, 134 s serially)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
if os.environ.get("CFX_TEST_THREADS"):  # a comparison's tolerance must hold under 1, 2 and 4 threads
    os.environ["OMP_NUM_THREADS"] = os.environ["CFX_TEST_THREADS"]
    torch.set_num_threads(int(os.environ["CFX_TEST_THREADS"]))
if os.environ.get("CFX_TOLERANCE_AUDIT"):  # each assert_close's margin, per call site (tolerance_audit.py)
    from cfx_tests.tolerance_audit import install

    install(os.environ["CFX_TOLERANCE_AUDIT"])


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the marker, not a parameter id that says "gpu"
            item.add_marker(skip)


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker more than the cores (``--maxprocesses`` caps it). The suite waits on
    subprocesses (torchrun ranks starting, notebook kernels, elastic restarts) about a tenth of its time;
    the extra worker runs tests then (measured on 2 cores: the suite used 1.76 of 2 cores with 2 workers).
    No test asserts a timing against another process's."""
    return (os.cpu_count() or 1) + 1
