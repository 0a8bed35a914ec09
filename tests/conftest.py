"""Test set-up: Triton's interpreter on machines without a GPU, the `gpu` marker elsewhere."""
import os

# JAX and torch share the GPU in one process: without this JAX takes 75% of its memory when the
# probe below first creates its client (before any test module could say otherwise).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# The library's own probe (JAX's default backend is a CUDA GPU), the one every test asks
# (tests.helpers.HAS_GPU): where it says yes, implementation=None and "triton" run the compiled
# kernels, so the tests do too. It imports jax but not triton: TRITON_INTERPRET must be set
# before anything imports triton (one interpreter mode per process).
from jax_fusedloss._triton_jax import on_cuda_gpu

HAS_GPU = on_cuda_gpu()
if not HAS_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

try:  # hypothesis profiles for tests/test_properties.py: JFL_HYPOTHESIS_PROFILE=ci (default) | gpu
    from hypothesis import HealthCheck, Phase, settings

    _SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]
    settings.register_profile("ci", max_examples=3, deadline=None, derandomize=True,
                              suppress_health_check=_SLOW_OK,
                              phases=[Phase.explicit, Phase.generate])  # no slow shrinking
    settings.register_profile("gpu", max_examples=150, deadline=None, derandomize=True,
                              suppress_health_check=_SLOW_OK)
    settings.load_profile(os.environ.get("JFL_HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # hypothesis is in [dev]; without it test_properties.py is skipped
    pass


def pytest_runtest_teardown(item):
    """On a GPU, where one process runs real-size tests (peaks of tens of GB) one after
    another beside child processes: torch's cached blocks go back to the device after each
    test (on an 80 GB H100 the tests after the large ones ran out of memory, each passing
    alone; JAX's own pool keeps its peak, see benchmarks/NOTES.md, eighteenth session)."""
    if HAS_GPU:
        import gc
        import sys

        gc.collect()
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            torch.cuda.empty_cache()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_cpu = pytest.mark.skip(reason="interpreter test: runs only without a GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip_gpu)
        if "interpreter" in item.fixturenames and HAS_GPU:
            item.add_marker(skip_cpu)


@pytest.fixture
def interpreter():
    """Marks a test that needs Triton's interpreter (the CPU suite)."""
    return True


@pytest.fixture(params=["rows", "split"])
def path(request, monkeypatch):
    """Runs a test on both launch paths of the Triton kernels (see helpers.force_path)."""
    from tests.helpers import force_path

    return force_path(request.param, monkeypatch)
