"""The process world autopar runs in: torchrun's environment and torch.distributed's process group."""

from __future__ import annotations

import atexit
import gc
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

from ..errors import AutoparError, EnvironmentVariableError
from .env import LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, RANK, WORLD_SIZE, env_int, env_is_set


@dataclass(frozen=True)
class World:
    size: int  # processes in the job
    rank: int  # this process's global rank
    local_rank: int  # this process's index on its node
    local_size: int  # processes on this node


def world() -> World:
    """The current world: the process group if one is initialised, else torchrun's environment, else one process."""
    if dist.is_available() and dist.is_initialized():
        size, rank = dist.get_world_size(), dist.get_rank()
    else:
        size, rank = env_int(WORLD_SIZE, 1), env_int(RANK, 0)
    return World(size=size, rank=rank, local_rank=env_int(LOCAL_RANK, rank),
                 local_size=env_int(LOCAL_WORLD_SIZE, size))


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


#: Seconds the main thread gives the GIL away at the exit of a process of a job of several (see `settle_at_exit`).
EXIT_SETTLE_S = 0.2
_settle_registered = False


def _settle_collectives() -> None:
    """atexit: let torch.distributed's worker threads let go of their last collectives while Python still runs.

    Why (issue 34: a rank of a user's torchrun script, one run in 5 to 30 on gloo, aborted after its last line:
    "terminate called without an active exception"; gdb, 2026-12-05): Python returns from a collective once its
    work is marked done, but the gloo worker thread that ran it drops its own reference a moment later. If that is
    the last one, the work's destructor releases its tensors' Python objects and asks for the GIL; when the main
    thread has by then reached the interpreter's finalization, CPython ends the asking thread (pthread_exit), the
    unwind crosses a destructor that may not throw, and std::terminate aborts the rank. atexit handlers run before
    finalization: a collection, then a sleep with the GIL released, lets the workers finish first. (torch does not
    do it itself: pytorch/pytorch#179291, abandoned.)"""
    gc.collect()
    time.sleep(EXIT_SETTLE_S)


def settle_at_exit() -> None:
    """Register `_settle_collectives` once per process (a process of a job of several ranks)."""
    global _settle_registered
    if not _settle_registered:
        atexit.register(_settle_collectives)
        _settle_registered = True


def ensure_process_group() -> World:
    """Initialise torch.distributed from torchrun's environment when the job has several processes and the
    user has not done it (NCCL on GPUs, gloo on CPU); bind this process to its GPU. A process of a job of several
    lets its collectives settle at exit (`settle_at_exit`)."""
    w = world()
    if w.size > 1:
        settle_at_exit()
    if torch.cuda.is_available():
        torch.cuda.set_device(w.local_rank % max(torch.cuda.device_count(), 1))
    if w.size > 1 and not dist.is_initialized():
        if not env_is_set(MASTER_ADDR):
            raise EnvironmentVariableError(
                f"WORLD_SIZE={w.size} but no MASTER_ADDR: launch the job with torchrun, or call "
                "torch.distributed.init_process_group yourself before autopar.wrap."
            )
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    return w


def local_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _collective_device() -> torch.device | None:
    """Where the collectives below put their tensors (the GPU under NCCL), or None without a group of several."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return local_device() if dist.get_backend() == "nccl" else torch.device("cpu")


def broadcast_text(text: str | None, *, src: int = 0) -> str:
    """Rank `src`'s text on every rank (as bytes in a tensor: nothing is unpickled)."""
    device = _collective_device()
    if device is None:
        assert text is not None, "broadcast_text without a process group needs the text"
        return text
    data = (text or "").encode()
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(length, src=src)
    if int(length.item()) == 0:
        return ""
    buf = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    if dist.get_rank() == src:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, src=src)
    return bytes(buf.cpu().tolist()).decode()


def backend() -> str | None:
    """The default process group's backend as torch.distributed names it ("nccl", "gloo", "cpu:gloo,cuda:nccl"), or
    None without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return str(dist.get_backend())


def ensure_single_process_group() -> None:
    """A one-process group (NCCL on a GPU, gloo on CPU) for FSDP2 on a job without one (CPU offload on one GPU)."""
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def min_max(value: int) -> tuple[int, int]:
    """Collective: the smallest and the largest of every rank's `value` (one process: the value twice)."""
    device = _collective_device()
    if device is None:
        return value, value
    t = torch.tensor([value, -value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t[0].item()), int(-t[1].item())


def ranks_with(flags: list[bool]) -> list[int]:
    """Collective: for each of `flags` (a list of one length on every rank), on how many ranks it is set (one process:
    0 or 1; under a fake process group, autopar.exact's, where every rank is this one: 0 or the world size)."""
    device = _collective_device()
    if device is not None and dist.get_backend() == "fake":
        return [int(f) * dist.get_world_size() for f in flags]
    t = torch.tensor([int(f) for f in flags], dtype=torch.int64, device=device or "cpu")
    if device is not None and len(flags):
        dist.all_reduce(t)
    return [int(v) for v in t.tolist()]


def first_failure(error: BaseException | None) -> None:
    """Collective: raise on every rank if any rank had `error` (so no rank waits forever for a failed one)."""
    device = _collective_device()
    if device is None:
        if error is not None:
            raise error
        return
    flag = torch.tensor([dist.get_rank() if error is not None else dist.get_world_size()], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    failed = int(flag.item())
    if error is not None:
        raise error
    if failed < dist.get_world_size():
        raise AutoparError(f"rank {failed} failed (its error is in its own output); every rank stops.")


def close_process_group() -> None:
    """End this process's torch.distributed in order: a barrier (no rank leaves while a peer still talks to it),
    then destroy_process_group. Gloo's worker threads outlive it: they end only when the last reference to the
    group goes, and after the model is gone torch's DTensor specs still hold its device mesh, which holds the
    group (seen on torch 2.13: two DeviceMesh and the group alive after a collection). A process that then lets
    Python finalize can abort, so a rank that owns its process ends with `end_rank_process` after this."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_world_size() > 1:
        dist.barrier()
    dist.destroy_process_group()


def end_rank_process(code: int = 0) -> NoReturn:
    """End a rank's process without Python's finalization: flush the output, the log handlers and pending
    garbage, then os._exit(code).

    Why (issue 34, item 1: the demo exited non-zero about one run in five): after destroy_process_group a gloo
    worker thread is still alive and may still hold the tensors of the last collective it ran, which Python
    already let go. If it drops them while the interpreter finalizes, it needs the GIL; CPython ends a thread
    that asks for the GIL then (pthread_exit), the unwind runs through a C++ destructor that may not throw, and
    std::terminate aborts the rank ("terminate called without an active exception", SIGABRT), so torchrun
    fails the job after every step succeeded. Leaving through os._exit never finalizes the interpreter."""
    gc.collect()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be written anyway
            pass
    os._exit(code)
