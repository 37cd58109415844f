"""Multi-process training with torch.distributed: the process group, FSDP2 sharding, and the few
collectives the trainer needs. A plain `deployrl train` is a world of one, where none of this runs;
`torchrun --nproc_per_node=N -m deployrl train ...` starts N ranks.

The layout is *data global, compute sharded*. Each heavy stage (generation, the no-grad pass, the
graded pass) runs on this rank's share of the step's groups or rows, and its small per-token
results ([rows, T] token ids, log-probabilities and proxies; never [rows, T, V]) are all-gathered,
so every rank holds the step's whole batch. What lies between the heavy stages (group
advantages, δ statistics, λ and its dual step, the cutoff plan) is then the single-process code
run on identical data: every rank takes the same decisions without further messages, and the
gradient of an N-rank step is the 1-process gradient of the same global batch.

Shares are balanced by tokens (`balanced_shares`), and groups never split across ranks in the
stages that need whole groups. FSDP2 all-gathers a layer's weights in every forward, so the ranks
must run the same number of forward (and backward) calls; since every rank knows every rank's
share, a rank with fewer micro-batches than another adds filler calls (a one-token forward whose
loss is multiplied by zero) without asking.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from deployrl.models.lora import is_adapter_name
from deployrl.settings.model import Device


@dataclass(frozen=True)
class World:
    """This process's place among the ranks; the default is a single process."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    backend: Optional[str] = None  # None: no process group
    device: torch.device = torch.device("cpu")  # the trainer's: model, optimizer state, passes

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_world(device: str = "auto", timeout_s: float = 1800.0) -> World:
    """The World of this process from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK), its
    trainer on `device` (`model.device`: auto, cpu or cuda, resolved by `Device.resolve`).

    With more than one rank the process group is started: NCCL when the device is CUDA (each rank
    on cuda:LOCAL_RANK), gloo on CPU. A collective that waits longer than `timeout_s` fails.
    """
    size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    where = Device.get("model.device", device).resolve(local_rank)
    if where.type == "cuda":
        torch.cuda.set_device(where)
    if size == 1:
        return World(device=where)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if where.type == "cuda" else "gloo", timeout=timedelta(seconds=timeout_s))
    return World(int(os.environ["RANK"]), size, local_rank, dist.get_backend(), where)


def shard(root: torch.nn.Module, blocks: Sequence[torch.nn.Module], world: World, dtype: torch.dtype) -> None:
    """FSDP2 on `root`: each of `blocks` (the decoder layers) is its own unit, `root` holds the rest.

    On GPU the parameters are all-gathered in bf16 and gradients reduced in fp32 (the weights and
    the optimizer stay in `dtype`); on CPU everything stays in `dtype`. Gradients are summed across
    ranks, not averaged: the loss of each rank is already normalised by the global batch.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(world.device.type, (world.size,))
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if world.device.type == "cuda" else MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
    )
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(root, mesh=mesh, mp_policy=policy)
    for module in root.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no pre-multiplied sum


def balanced_shares(costs: Sequence[float], size: int) -> list[list[int]]:
    """Items (by index) dealt to `size` ranks so that the largest total cost is small.

    Longest first, each to the least loaded rank (ties: the lower rank): a deterministic function
    of `costs`, so every rank computes the same shares without a message. Each share is sorted.
    """
    loads = [0.0] * size
    shares: list[list[int]] = [[] for _ in range(size)]
    for item in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(size), key=lambda r: (loads[r], r))
        shares[rank].append(item)
        loads[rank] += costs[item]
    return [sorted(s) for s in shares]


def contiguous_shares(count: int, size: int) -> list[range]:
    """range(count) cut into `size` consecutive pieces whose lengths differ by at most one."""
    base, extra = divmod(count, size)
    starts = [r * base + min(r, extra) for r in range(size + 1)]
    return [range(starts[r], starts[r + 1]) for r in range(size)]


def all_gather_rows(tensor: torch.Tensor, world: World) -> list[torch.Tensor]:
    """Every rank's `tensor` [rows_r, width_r, ...] (rows and width may differ), on CPU, by rank."""
    if not world.distributed:
        return [tensor]
    if tensor.dtype == torch.bool:  # gloo does not move bools
        return [piece.bool() for piece in all_gather_rows(tensor.to(torch.uint8), world)]
    device = world.device
    shape = torch.tensor(list(tensor.shape) + [0] * (2 - tensor.dim()), device=device)[:2]
    shapes = [torch.zeros_like(shape) for _ in range(world.size)]
    dist.all_gather(shapes, shape)
    rows = max(int(s[0]) for s in shapes)
    width = max(int(s[1]) for s in shapes)
    padded = tensor.new_zeros((rows, width, *tensor.shape[2:]) if tensor.dim() > 1 else (rows,))
    if tensor.dim() > 1:
        padded[: tensor.shape[0], : tensor.shape[1]] = tensor
    else:
        padded[: tensor.shape[0]] = tensor
    padded = padded.to(device)
    gathered = [torch.empty_like(padded) for _ in range(world.size)]
    dist.all_gather(gathered, padded)
    out = []
    for piece, s in zip(gathered, shapes):
        piece = piece.cpu()[: int(s[0])]
        out.append(piece[:, : int(s[1])] if tensor.dim() > 1 else piece)
    return out


def gather_in_order(local: torch.Tensor, shares: Sequence[Sequence[int]], world: World) -> torch.Tensor:
    """The global tensor [N, width, ...] whose rows `shares[r]` were computed by rank r as `local`.

    Rows are right-padded with zeros to the widest rank's width.
    """
    pieces = all_gather_rows(local, world)
    width = max(p.shape[1] for p in pieces) if local.dim() > 1 else None
    count = sum(len(s) for s in shares)
    shape = (count, width, *local.shape[2:]) if width is not None else (count,)
    out = local.new_zeros(shape, device="cpu")
    for piece, rows in zip(pieces, shares):
        if len(rows):
            index = torch.tensor(list(rows))
            if width is not None:
                out[index, : piece.shape[1]] = piece
            else:
                out[index] = piece
    return out


def all_reduce_sum(values: Sequence[float], world: World) -> list[float]:
    """Element-wise sums of `values` over the ranks (float64)."""
    if not world.distributed:
        return list(values)
    tensor = torch.tensor(list(values), dtype=torch.float64, device=world.device)
    dist.all_reduce(tensor)
    return tensor.cpu().tolist()


def all_reduce_tensor(tensor: torch.Tensor, world: World) -> torch.Tensor:
    """The element-wise sum of `tensor` over the ranks, on CPU (`tensor` itself when not distributed)."""
    if not world.distributed:
        return tensor
    summed = tensor.to(world.device)
    dist.all_reduce(summed)
    return summed.cpu()


def close_world(world: World) -> None:
    """Destroy the process group of a distributed `world` once every rank has arrived: a rank that
    destroys it while another still works (rank 0 writing files) was seen to abort at exit (SIGABRT
    in gloo's teardown). One process leaves torch.distributed alone: a group there is someone
    else's (in-process vLLM starts one and tears it down at exit)."""
    if world.distributed:
        dist.barrier()
        dist.destroy_process_group()


def barrier(world: World) -> None:
    """Wait until every rank of `world` arrives here (a world of one goes straight on)."""
    if world.distributed:
        dist.barrier()


def any_rank(flag: bool, world: World) -> bool:
    """True on every rank when `flag` is True on at least one."""
    return all_reduce_sum([float(flag)], world)[0] > 0


def full_state_dict(
    model: torch.nn.Module, world: World, to_main_only: bool = False, base: bool = True,
) -> dict[str, torch.Tensor]:
    """The model's unsharded weights (with `base=False` its LoRA adapters only, all an engine
    serving them needs): on every rank, where the model lives, or (`to_main_only`) on rank 0's host
    only (the others get {}). In one process they are the model's own tensors, detached: nothing is
    copied, and an engine copies only what it needs. A sharded model is gathered one tensor at a
    time (each DTensor's `full_tensor()`, a collective every rank makes in the same order), so no
    rank ever holds a second whole model beside what it keeps."""
    kept = {name: value for name, value in model.state_dict().items() if base or is_adapter_name(name)}
    if not world.distributed:
        return {name: value.detach() for name, value in kept.items()}
    from torch.distributed.tensor import DTensor

    gathered = {}
    for name, value in kept.items():
        whole = value.full_tensor() if isinstance(value, DTensor) else value
        if not to_main_only:
            gathered[name] = whole.detach()
        elif world.is_main:
            gathered[name] = whole.detach().cpu()
    return gathered
