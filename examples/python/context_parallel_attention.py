"""Context-parallel causal self-attention prefill over torch.distributed.

Each rank holds one shard of the sequence (its queries, keys and values). It reads its queries
against its own keys causally, and against every earlier rank's keys (gathered) with every key
visible; the partial results are merged with their log-sum-exps (ovq.merge). The merged output
is the one-process causal attention, to rounding.

    python examples/python/context_parallel_attention.py
"""

import math

import torch
import torch.distributed as dist

import ovq

T, HEADS, D = 1024, 4, 64


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, HEADS, T, D, generator=g) for _ in range(3)]


def mixers():
    beta = 1 / math.sqrt(D)
    return ovq.SelfAttention(beta=beta), ovq.SelfAttention(beta=beta, causal=False)


def worker(rank, world, seed=0):
    q, k, v = inputs(seed)
    shard = T // world
    mine = slice(rank * shard, (rank + 1) * shard)
    q, k, v = (x[:, :, mine].contiguous() for x in (q, k, v))
    causal, every_key = mixers()
    # Every rank's keys and values (a ring would pass them along instead: same partials).
    keys = [torch.empty_like(k) for _ in range(world)]
    values = [torch.empty_like(v) for _ in range(world)]
    dist.all_gather(keys, k)
    dist.all_gather(values, v)

    layer = ovq.MultiHead(causal, 1, HEADS, HEADS, D, D)
    o, lse = layer.forward(q, k, v, return_lse=True)
    for earlier in range(rank):
        # A fresh non-causal read: every query sees all of that rank's keys (shards are equal).
        part = ovq.MultiHead(every_key, 1, HEADS, HEADS, D, D)
        o_s, lse_s = part.forward(q, keys[earlier], values[earlier], return_lse=True)
        o, lse = ovq.merge(o, lse, o_s, lse_s)
    return o


def single_process(seed=0):
    q, k, v = inputs(seed)
    causal, _ = mixers()
    return ovq.MultiHead(causal, 1, HEADS, HEADS, D, D).forward(q, k, v)


if __name__ == "__main__":
    from launch import launch

    shards = launch(worker, 2)
    merged = torch.cat(shards, dim=2)
    reference = single_process()
    err = (merged - reference).norm() / reference.norm()
    print(f"2 ranks, T = {T}: relative difference from one process {err:.2e}")
