"""One rank of tests/test_distributed.py's gather test, started by torchrun (never collected by pytest):

    torchrun --nproc_per_node=N gather_worker.py OUT

shards the tiny model with LoRA adapters (FSDP2, gloo) and writes OUT/rank{r}.safetensors: what
`full_state_dict` gives this rank for each way of asking, each tensor prefixed by the way
("all/", "main/", "adapters/", "adapters_main/"), next to torch's own gathered state dict ("reference/").
"""

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from tiny import tiny_model
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from deployrl.models.loading import decoder_blocks
from deployrl.models.lora import add_lora
from deployrl.training.distributed import close_world, full_state_dict, init_world, shard


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    world = init_world("cpu")
    model = add_lora(tiny_model(), 4, 8.0, 0.0, ("q_proj", "v_proj"))
    with torch.no_grad():  # adapters that are not zero, so that a wrong gather shows
        for name, parameter in model.named_parameters():
            if ".lora_B." in name:
                parameter.normal_(generator=torch.Generator().manual_seed(len(name)))
    shard(model, decoder_blocks(model), world, torch.float32)
    tensors = {f"reference/{k}": v for k, v in
               get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)).items()}
    for way, to_main_only, base in (("all", False, True), ("main", True, True), ("adapters", False, False),
                                    ("adapters_main", True, False)):
        tensors |= {f"{way}/{k}": v for k, v in full_state_dict(model, world, to_main_only, base).items()}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / f"rank{world.rank}.safetensors"))
    close_world(world)


if __name__ == "__main__":
    main()
