"""Sequence-parallel linear attention over torch.distributed.

Each rank summarises its shard of the stream from an empty state (S, z and its decay); the
summaries are gathered, and each rank chains those of the ranks before it, in order
(LinearAttention.chain), into the state its shard starts from; then it computes its outputs.
With two ranks they are the one-process outputs bit for bit; with more, to rounding (the chained
sums associate differently).

    python examples/python/linear_sequence_parallel.py
"""

import torch

import ovq
from ovq.distributed import all_gather_states

T, D, CHUNK = 2048, 64, 64


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(T, D, generator=g) * 0.3 for _ in range(3)]


def mixer():
    return ovq.LinearAttention(feature_map="elu1", normalize=True, decay=0.999, chunk=CHUNK)


def worker(rank, world, seed=0):
    q, k, v = inputs(seed)
    shard = T // world  # a multiple of the chunk, so every shard starts on a chunk boundary
    mine = slice(rank * shard, (rank + 1) * shard)
    lin = mixer()
    summary = lin.make_state(D, D)
    lin.absorb(summary, k[mine], v[mine])
    summaries = all_gather_states(summary, lin)
    start = lin.make_state(D, D)
    for earlier in summaries[:rank]:
        start = lin.chain(start, earlier)
    return lin.forward(start, q[mine], k[mine], v[mine])


def single_process(seed=0):
    q, k, v = inputs(seed)
    lin = mixer()
    return lin.forward(lin.make_state(D, D), q, k, v)


if __name__ == "__main__":
    from launch import launch

    out = torch.cat(launch(worker, 2))
    print("2 ranks equal one process bit for bit:", torch.equal(out, single_process()))
