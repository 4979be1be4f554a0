"""ovq.distributed: moving ovq states between torch.distributed processes.

A state travels as its state-file bytes in a uint8 tensor (bitwise the state, any backend that
moves uint8 tensors: gloo, or NCCL through a CUDA copy). Three ways to spread a sequence over
processes (examples/python/ shows each):

- softmax mixers: each process reads its queries against every shard of keys it is sent and
  merges the partial results with ovq.merge (their log-sum-exps come from return_lse=True);
- linear attention: each process summarises its shard from an empty state, the summaries are
  gathered and chained in order (LinearAttention.chain) into each shard's starting state;
- OVQ, whose online k-means depends on order and has no associative merge: one process absorbs
  the prompt and sends its state (send_state); another loads it and decodes.
"""

import torch
import torch.distributed as dist

import ovq

__all__ = ["state_tensor", "send_state", "recv_state", "broadcast_state", "all_gather_states"]


def state_tensor(state):
    """The state-file bytes of a state or a MultiHead layer, as a uint8 tensor."""
    return torch.frombuffer(bytearray(state.to_bytes()), dtype=torch.uint8)


def _load(target, data):
    if isinstance(target, ovq.MultiHead):
        target.load_bytes(data)
        return target
    return target.load_state(data)


def send_state(state, dst, group=None):
    """Sends a state (or a MultiHead layer's states) to rank dst: its size, then its bytes."""
    payload = state_tensor(state)
    dist.send(torch.tensor([payload.numel()], dtype=torch.int64), dst, group=group)
    dist.send(payload, dst, group=group)


def recv_state(mixer_or_layer, src, group=None):
    """Receives what send_state sent from rank src: a state of the mixer's options, or the
    states of a MultiHead layer loaded in place (the layer is returned)."""
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src, group=group)
    payload = torch.empty(int(size[0]), dtype=torch.uint8)
    dist.recv(payload, src, group=group)
    return _load(mixer_or_layer, payload)


def broadcast_state(state, mixer_or_layer, src, group=None):
    """Rank src's state on every rank (`state` is only read on src)."""
    size = torch.empty(1, dtype=torch.int64)
    payload = None
    if dist.get_rank(group) == src:
        payload = state_tensor(state)
        size[0] = payload.numel()
    dist.broadcast(size, src, group=group)
    if payload is None:
        payload = torch.empty(int(size[0]), dtype=torch.uint8)
    dist.broadcast(payload, src, group=group)
    return state if dist.get_rank(group) == src else _load(mixer_or_layer, payload)


def all_gather_states(state, mixer, group=None):
    """Every rank's state, in rank order, on every rank."""
    payload = state_tensor(state)
    world = dist.get_world_size(group)
    sizes = [torch.empty(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([payload.numel()], dtype=torch.int64), group=group)
    longest = max(int(s[0]) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    return [mixer.load_state(g[: int(s[0])]) for g, s in zip(gathered, sizes)]
