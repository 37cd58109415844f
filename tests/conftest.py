import pytest
import torch

# Two cores shared with a busy neighbour: small torch ops slow down badly with more threads.
torch.set_num_threads(1)


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)
