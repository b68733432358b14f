"""Processes: torchrun's environment to a process group and a device; the few collectives the trainer uses.

torchrun (or ``accelerate launch``) sets RANK / WORLD_SIZE / LOCAL_RANK; fastppo then uses NCCL on
GPUs and Gloo on CPUs. A single process (``python -m fastppo.train``) needs no process group.

Every collective fastppo makes itself goes through this module's wrappers, which turn the backend's timeout
into ``fastppo.errors.CollectiveTimeout`` (``collective``).
"""
from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fastppo.errors import CollectiveTimeout


@dataclass
class DistState:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    initialized_here: bool

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_distributed(timeout_s: int = 1800, use_cpu: bool = False, need_group: bool = False) -> DistState:
    """torchrun sets RANK/WORLD_SIZE/LOCAL_RANK: then NCCL on GPUs, Gloo on CPU. Else one process.

    ``timeout_s`` (``--ddp_timeout``) bounds every collective: a rank that waits longer for a frozen or
    dead peer fails with an error instead of blocking forever. ``need_group``: a process group even for
    one process (DeepSpeed needs one; it is then made in-process, without torchrun's variables)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available() and not use_cpu
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    initialized_here = False
    if world > 1 and not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        backend = "nccl" if cuda else "gloo"
        with collective("init_process_group (the processes' rendezvous)"):
            if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                # torchrun's agent keeps one store across elastic restarts: without a namespace per restart a
                # restarted rank can read the previous attempt's addresses and fail to connect (pytorch#135712)
                store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                      timeout=timeout)
                store = dist.PrefixStore(f"fastppo/restart-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}",
                                         store)
                dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
            else:
                dist.init_process_group(backend, timeout=timeout)
        initialized_here = True
    elif need_group and not dist.is_initialized():
        backend = "nccl" if cuda else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=timeout_s))
        initialized_here = True
    return DistState(rank, world, local_rank, device, initialized_here)


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def collective(what: str):
    """Around a collective named ``what``: the backend's error for a timeout (torch raises a ``RuntimeError``,
    or its ``DistBackendError``/``DistStoreError``, whose message says it timed out) is re-raised as
    ``CollectiveTimeout`` naming the call. Any other error passes through unchanged."""
    try:
        yield
    except CollectiveTimeout:
        raise
    except RuntimeError as e:
        message = str(e)
        if "timed out" not in message.lower() and "timeout" not in message.lower():
            raise
        raise CollectiveTimeout(what, message.splitlines()[0] if message else type(e).__name__) from e


def all_reduce(t: torch.Tensor, op=None) -> torch.Tensor:
    """In-place all-reduce (sum by default); a no-op in a single process."""
    if is_distributed():
        with collective("all_reduce"):
            dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t


def all_reduce_min(t: torch.Tensor) -> torch.Tensor:
    return all_reduce(t, dist.ReduceOp.MIN if dist.is_available() else None)


def all_gather(tensors: list[torch.Tensor], t: torch.Tensor) -> list[torch.Tensor]:
    """``tensors`` (one per process, as ``t``) filled with every process's ``t``."""
    with collective("all_gather"):
        dist.all_gather(tensors, t)
    return tensors


def barrier() -> None:
    if is_distributed():
        with collective("barrier"):
            dist.barrier()


class AcceleratorView:
    """What TRL's scripts and callbacks read of ``trainer.accelerator`` (accelerate's ``Accelerator``), answered from
    fastppo's own process group: ``print`` (the main process only), the process counts and indices, ``device``,
    ``wait_for_everyone()`` and ``unwrap_model`` (DDP's and DeepSpeed's wrappers taken off)."""

    def __init__(self, state: DistState):
        self.state = state

    @property
    def is_main_process(self) -> bool:
        return self.state.is_main

    @property
    def is_local_main_process(self) -> bool:
        return self.state.local_rank == 0

    @property
    def num_processes(self) -> int:
        return self.state.world_size

    @property
    def process_index(self) -> int:
        return self.state.rank

    @property
    def local_process_index(self) -> int:
        return self.state.local_rank

    @property
    def device(self) -> torch.device:
        return self.state.device

    def print(self, *args, **kwargs) -> None:
        if self.state.is_main:
            print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        barrier()

    @staticmethod
    def unwrap_model(model, keep_fp32_wrapper: bool = True):
        while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
            model = model.module
        return model
