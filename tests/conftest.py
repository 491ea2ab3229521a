"""Shared test set-up: nothing in the test suite may reach the network."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The models under test are tiny: one intra-op thread is faster than two, and
# leaves the other core to the trio thread and to pytest.
import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

# Without a GPU, Triton kernels run in its interpreter; set it before any test
# module imports a kernel, whatever order the modules load in.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """A test marked ``gpu`` needs a CUDA device: without one it is skipped, here, so
    test modules carry the one marker and no skip condition of their own."""
    if torch.cuda.is_available():
        return
    needs_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(needs_cuda)


@pytest.fixture
def enable_pdl(monkeypatch):
    """A function that turns programmatic dependent launch on (``TRIO_LLM_PDL=1``,
    gpu/kernels/pdl.py) for the rest of the test, or skips the test where the device
    or Triton cannot launch with it. Until it is called, PDL is off (``TRIO_LLM_PDL=0``,
    the plain launches a test compares with)."""
    from trio_llm.gpu.kernels import pdl

    monkeypatch.setenv("TRIO_LLM_PDL", "0")
    pdl.pdl_enabled.cache_clear()

    def enable() -> None:
        monkeypatch.setenv("TRIO_LLM_PDL", "1")
        pdl.pdl_enabled.cache_clear()
        if not pdl.pdl_enabled(torch.device("cuda")):
            pytest.skip("PDL needs SM 9.0 or later and Triton's grid dependency control")

    yield enable
    pdl.pdl_enabled.cache_clear()
