"""Process-group set-up for ``torchrun`` + DistributedDataParallel (nothing home-made).

Under torchrun, RANK/WORLD_SIZE/LOCAL_RANK are set; we use gloo on CPU and nccl on GPU.
Every rank builds the same global batches and trains on its shard (rows rank::world).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dynaseq.core.config import check_precision


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed(device: torch.device) -> DistEnv:
    """Join the process group when launched by torchrun; a no-op for one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistEnv()
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return DistEnv(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))


def pick_device(name: str | torch.device | None, env_local_rank: int | None = None,
                what: str = "device") -> torch.device:
    """The device ``name`` names: ``auto`` (or None) uses CUDA when present (one GPU per
    local rank), else the CPU; ``cpu`` (any case, any index, or a ``torch.device``) the
    CPU; ``cuda`` the local rank's GPU and ``cuda:N`` GPU N. Raises
    :class:`~dynaseq.core.errors.ConfigError` naming ``what`` for another device type, a
    value that is not one, or CUDA asked of a machine without it."""
    from dynaseq.core.errors import ConfigError

    if name is None or (isinstance(name, str) and name.lower() == "auto"):
        if not torch.cuda.is_available():
            return torch.device("cpu")
        name = "cuda"
    dev = None
    if isinstance(name, str | torch.device):
        try:
            dev = torch.device(name.lower() if isinstance(name, str) else name)
        except (RuntimeError, ValueError):
            pass
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"{what} must be auto, cpu, cuda or cuda:N, got {name!r}")
    if dev.type == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(f"{what}={name} but no CUDA device is available")
    if dev.index is None:
        rank = int(os.environ.get("LOCAL_RANK", 0)) if env_local_rank is None else env_local_rank
        dev = torch.device("cuda", rank)
    if dev.index >= torch.cuda.device_count():
        raise ConfigError(f"{what}={name}: this machine has {torch.cuda.device_count()} "
                          "CUDA device(s)")
    torch.cuda.set_device(dev.index)
    return dev


def pick_dtype(precision: str) -> torch.dtype:
    """The dtype of a precision name (``fp32`` or ``bf16``, :data:`~dynaseq.core.config.
    PRECISIONS`); raises :class:`~dynaseq.core.errors.ConfigError` for another name."""
    check_precision(precision)
    return torch.bfloat16 if precision == "bf16" else torch.float32


def precision_of(model: torch.nn.Module) -> str:
    """``bf16`` when the model's (first) parameters are bfloat16, else ``fp32``: the
    precision a loaded model runs at (what profiles and latency tables record)."""
    return "bf16" if next(model.parameters()).dtype == torch.bfloat16 else "fp32"


def all_reduce_sum(values: list[float], env: DistEnv, device: torch.device) -> list[float]:
    if not env.enabled:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over the ranks of the process group, differentiably (the backward pass
    sums the gradients of every rank's use of the result back to each rank's ``t``); ``t``
    itself in a single process. Every rank must call it for the same tensors in the same
    order (as the micro-batches of one update are)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return t
    from torch.distributed.nn.functional import all_reduce

    return all_reduce(t)


def barrier(env: DistEnv) -> None:
    if env.enabled:
        dist.barrier()


def cleanup(env: DistEnv) -> None:
    if env.enabled and dist.is_initialized():
        dist.destroy_process_group()
