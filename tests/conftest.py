import pytest
import torch

# Two cores shared with a busy neighbour: small torch ops slow down badly with more threads.
torch.set_num_threads(1)


# the trainer's devices a test runs on: the GPU check runs the same tests on CUDA (docs/gpu.md)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    from tiny import save_tiny

    return save_tiny(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """A tiny random Llama in a GGUF that carries SmolLM2's tokenizer and chat template."""
    from tiny import tiny_model

    from deployrl.engines.gguf_io import write_gguf
    from deployrl.models.loading import resolve_model

    model = tiny_model("llama", vocab_size=49152, hidden_size=64, init_std=0.05)
    template = resolve_model("smollm2-135m").gguf_path
    return write_gguf(model.state_dict(), model.config, template, tmp_path_factory.mktemp("gguf") / "tiny.gguf", "f32")


@pytest.fixture(scope="session")
def report_to_terminal(request):
    """A function that prints a line past pytest's output capture, onto the terminal (the fault and
    fuzz suites report their counts with it)."""
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")

    def write(line: str) -> None:
        if reporter is not None and capture is not None:
            with capture.global_and_fixture_disabled():
                reporter.write("\n")
                reporter.write_sep("-", line)

    return write
