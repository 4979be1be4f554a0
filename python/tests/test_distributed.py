"""Two processes on 127.0.0.1 under torch.distributed (gloo): the three examples of
examples/python/ against one process doing the same work."""

import os
import sys

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "python")
sys.path.insert(0, os.path.abspath(EXAMPLES))

import context_parallel_attention  # noqa: E402
import linear_sequence_parallel  # noqa: E402
import ovq_prefill_decode  # noqa: E402
from launch import launch  # noqa: E402



def test_context_parallel_self_attention():
    merged = torch.cat(launch(context_parallel_attention.worker, 2), dim=2)
    reference = context_parallel_attention.single_process()
    assert ((merged - reference).norm() / reference.norm()).item() < 1e-5


def test_linear_attention_shards_chained():
    out = torch.cat(launch(linear_sequence_parallel.worker, 2))
    assert torch.equal(out, linear_sequence_parallel.single_process())


def test_ovq_prefill_on_one_rank_decode_on_another():
    decoded = launch(ovq_prefill_decode.worker, 2)[1]
    assert torch.equal(decoded, ovq_prefill_decode.single_process())
