"""Runs a worker in `world` processes on 127.0.0.1 under torch.distributed (gloo) and returns
what each rank returned, in rank order, within a time limit. The examples' and the tests'
shared launcher."""

import datetime
import os
import socket
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, out_dir, timeout, worker, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))
    try:
        result = worker(rank, world, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def launch(worker, world, *args, timeout=120):
    """worker(rank, world, *args) on every rank; its return values, rank 0 first. Raises
    TimeoutError (the processes killed) if they take more than `timeout` seconds."""
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_entry, args=(world, _free_port(), out_dir, timeout, worker, args),
                                 nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=max(deadline - time.monotonic(), 0.1)):
            if time.monotonic() >= deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{worker.__name__} on {world} ranks took over {timeout} s")
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]
