import gc
import threading
import time

import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped cleanly where there is none)")
    config.addinivalue_line("markers", "multigpu: needs two or more CUDA GPUs")


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if has_cuda else 0
    skip_cuda = pytest.mark.skip(reason="no CUDA device on this machine")
    skip_multi = pytest.mark.skip(reason=f"needs >= 2 CUDA devices, found {gpus}")
    for item in items:
        if "cuda" in item.keywords and not has_cuda:
            item.add_marker(skip_cuda)
        elif "multigpu" in item.keywords and gpus < 2:
            item.add_marker(skip_multi)


def pipeline_threads():
    """Names of live loader pipeline threads (fetch / stage), which must not outlive an iterator."""
    return sorted(
        t.name
        for t in threading.enumerate()
        if t.name.startswith(("fastload-fetch", "fastload-stage")) and t.is_alive()
    )


@pytest.fixture
def no_leaked_threads():
    """Fail a test that leaves loader pipeline threads running after it drops its iterators."""
    before = pipeline_threads()
    yield
    gc.collect()
    deadline = time.monotonic() + 5.0  # an iterator collected off the main thread stops asynchronously
    while pipeline_threads() != before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pipeline_threads() == before
