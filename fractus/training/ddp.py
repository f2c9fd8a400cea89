"""The trainer's processes under ``torchrun`` (DDP): gloo on CPU, NCCL on CUDA.

Rank r reads streams r·B … (r+1)·B − 1 of the training split, so N processes train as one process
with N·B streams. Every decision that ends or skips a step is taken by all of them together
(:func:`agree`), and rank 0 writes the checkpoint with every process's carried state
(:func:`gather_states`). A single process (no ``WORLD_SIZE``) makes none of these calls.
"""
from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist


def setup_distributed(device: str):
    """(rank, world, device) — from torchrun's environment, or a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, torch.device(device)
    rank = int(os.environ["RANK"])
    if device.startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl")
        return rank, world, torch.device("cuda", local)
    dist.init_process_group("gloo")
    return rank, world, torch.device(device)


def gather_states(state, rank: int, world: int) -> list | None:
    """Every process's carried state (CPU), indexed by rank, on rank 0 (None elsewhere)."""
    if world == 1:
        return [state]
    states = [None] * world if rank == 0 else None
    dist.gather_object(state, states, dst=0)
    return states


def agree(finite: bool, stop: bool, ce: float, lb: float, device: torch.device,
          world: int) -> tuple[bool, bool, float, float]:
    """(every process's loss finite, any process asked to stop, CE and lb averaged over the
    processes): all take the same decisions and log the same numbers (one all-reduce)."""
    if world == 1:
        return finite, stop, ce, lb
    t = torch.tensor([float(not finite), float(stop), ce if finite else 0.0, lb if finite else 0.0],
                     dtype=torch.float64, device=device)
    dist.all_reduce(t)
    bad, stop_any, ce_sum, lb_sum = t.tolist()
    if bad:
        return False, bool(stop_any), float("nan"), float("nan")
    return True, bool(stop_any), ce_sum / world, lb_sum / world


def leave(signalled: bool) -> None:
    """End this process's part in the group. After a stop by a signal each process exits non-zero
    and torchrun terminates the rest after the first: each waits here, ignoring SIGTERM, until all
    are done. The group is destroyed in every case: without it a process can abort as it exits
    (seen with gloo)."""
    if signalled:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        dist.barrier()
    dist.destroy_process_group()
