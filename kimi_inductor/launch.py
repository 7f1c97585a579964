"""Run a function on G ranks (spawned processes: gloo on CPU, or NCCL with one GPU per
rank) and collect the results."""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str, backend: str, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    extra = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        extra["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, **extra)
    try:
        result: Any = ("ok", fn(*args))
        dist.barrier()  # no rank tears down its connections while a peer still reads its last sends
    except BaseException as exc:  # reported by the parent with the rank's traceback
        result = ("error", isinstance(exc, ValueError) and str(exc),
                  f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"{rank}.pkl").write_bytes(pickle.dumps(result))


def run_ranks(fn: Callable, world: int, *args: Any, backend: str = "gloo") -> list[Any]:
    """``fn(*args)`` on each of ``world`` ranks; returns every rank's result.

    ``fn`` runs with the default process group initialised (``dist.group.WORLD``); with
    ``backend="nccl"`` rank r owns GPU r (``torch.cuda.current_device()``).
    An exception on any rank is re-raised here as ``RuntimeError`` with its traceback; the
    same ``ValueError`` on every rank (a refused deployment) as that ``ValueError``, the
    ranks' tracebacks chained to it.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(world, _free_port(), out_dir, backend, fn, args), nprocs=world,
                           start_method="spawn", join=True)
        results = [pickle.loads(Path(out_dir, f"{r}.pkl").read_bytes()) for r in range(world)]
    errors = [r[1:] for r in results if r[0] == "error"]
    if errors:
        failure = RuntimeError("\n".join(text for _, text in errors))
        refusals = {why for why, _ in errors}
        if len(errors) == world and len(refusals) == 1 and all(refusals):
            raise ValueError(refusals.pop()) from failure
        raise failure
    return [r[1] for r in results]
