"""OVQ prefill on one process, decoding on another (the split serving engines make).

OVQ's online k-means depends on the order of the tokens, so its states have no associative
merge: rank 0 absorbs the prompt and sends its states (their state-file bytes, as a uint8
tensor); rank 1 loads them and decodes. The decoded outputs are bitwise those of one process
doing both.

    python examples/python/ovq_prefill_decode.py
"""

import torch

import ovq
from ovq.distributed import recv_state, send_state

PROMPT, DECODE, HQ, HKV, D = 4096, 32, 8, 2, 64


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    prompt = [torch.randn(1, h, PROMPT, D, generator=g) for h in (HKV, HKV)]
    steps = [torch.randn(DECODE, 1, h, D, generator=g) for h in (HQ, HKV, HKV)]
    return prompt, steps


def layer():
    return ovq.MultiHead(ovq.OVQAttention(capacity=512, chunk=64), 1, HQ, HKV, D, D)


def decode(model, steps):
    q, k, v = steps
    return torch.stack([model.step(q[i], k[i], v[i]) for i in range(DECODE)])


def worker(rank, world, seed=0):
    (k, v), steps = inputs(seed)
    model = layer()
    if rank == 0:
        model.absorb(k, v)
        send_state(model, dst=1)
        return None
    recv_state(model, src=0)
    return decode(model, steps)


def single_process(seed=0):
    (k, v), steps = inputs(seed)
    model = layer()
    model.absorb(k, v)
    return decode(model, steps)


if __name__ == "__main__":
    from launch import launch

    decoded = launch(worker, 2)[1]
    print("decoded on rank 1 equals one process bit for bit:",
          torch.equal(decoded, single_process()))
