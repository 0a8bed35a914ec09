"""Test set-up: Triton's interpreter on machines without a GPU, the `gpu` marker elsewhere."""
import os
import shutil

# Must happen before anything imports triton: one interpreter mode per process.
HAS_GPU = shutil.which("nvidia-smi") is not None and os.environ.get("TRITON_INTERPRET") != "1"
if not HAS_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402


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
