"""Fixtures shared by several test modules."""
import pytest


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny tensors: thread start-up costs far more than the work (10x slower with 2 threads).
    Modules of tiny CPU engine runs use it with `pytestmark = pytest.mark.usefixtures(...)`."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
