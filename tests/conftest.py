import pytest
import torch

# Two cores shared with a busy neighbour: small torch ops slow down badly with more threads.
torch.set_num_threads(1)


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    from tiny import save_tiny

    return save_tiny(tmp_path_factory.mktemp("tiny-llama"))
