"""ovq over torch tensors: zero-copy calls, 16-bit tensors, the ovq.torch ops and layers against
PyTorch's scaled_dot_product_attention and the library's references, torch.compile."""

import copy
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import ovq  # noqa: E402
import ovq.torch as otorch  # noqa: E402
from conftest import rel_err  # noqa: E402

B, HQ, HKV, T, D = 2, 4, 2, 96, 16


@pytest.fixture
def qkv():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, HQ, T, D, generator=g)
    k = torch.randn(B, HKV, T, D, generator=g)
    v = torch.randn(B, HKV, T, D, generator=g)
    return q, k, v


def test_tensors_are_read_and_written_in_place():
    mixer = ovq.SelfAttention()
    state = mixer.make_state(D, D)
    q, k, v = torch.randn(3, T, D).unbind(0)
    out = torch.empty(T, D)
    got = mixer.forward(state, q, k, v, out=out)
    assert got is out
    expected = mixer.forward(mixer.make_state(D, D), q.numpy(), k.numpy(), v.numpy())
    assert np.array_equal(out.numpy(), expected)
    assert isinstance(mixer.forward(mixer.make_state(D, D), q, k, v), torch.Tensor)
    with pytest.raises(ValueError, match="not C-contiguous"):
        mixer.forward(state, q.t().contiguous().t(), k, v)
    with pytest.raises(TypeError, match="float64"):
        mixer.forward(state, q.double(), k, v)
    with pytest.raises(TypeError, match="layout"):
        mixer.forward(state, q.to_sparse(), k, v)
    with pytest.raises(TypeError, match="meta"):
        mixer.forward(state, q.to("meta"), k, v)
    with pytest.raises(TypeError, match="int64"):
        mixer.forward(state, q.long(), k, v)
    assert state.t == T  # the first call only


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mixer", [ovq.SelfAttention(beta=0.25),
                                   ovq.OVQAttention(capacity=32, chunk=16, beta=0.25)], ids=repr)
def test_16_bit_tensors(mixer, dtype):
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(T, D, generator=g).to(dtype) for _ in range(3))
    s16 = mixer.make_state(D, D, dtype=dtype)
    o16, lse16 = mixer.forward(s16, q, k, v, return_lse=True)
    assert o16.dtype == dtype and lse16.dtype == torch.float32 and s16.dtype == str(dtype)[6:]
    s32 = mixer.make_state(D, D)
    o32 = mixer.forward(s32, q.float(), k.float(), v.float())
    assert rel_err(o16.float().numpy(), o32.numpy()) < 2e-2
    assert s16.keys.dtype == np.float32 if dtype == torch.bfloat16 else np.float16


def test_self_attention_matches_sdpa_causal_windowed_and_grouped(qkv):
    q, k, v = qkv
    scale = 1 / math.sqrt(D)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    layer = otorch.SelfAttention(B, HQ, HKV, D, D, beta=scale)
    assert rel_err(layer(q, k, v).numpy(), ref.numpy()) < 1e-5

    window = 9
    i = torch.arange(T)
    mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
    ref_w = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    windowed = otorch.SelfAttention(B, HQ, HKV, D, D, beta=scale, window=window)
    assert rel_err(windowed(q, k, v).numpy(), ref_w.numpy()) < 1e-5

    # lse against torch's logsumexp of the masked logits.
    o, lse = otorch.SelfAttention(B, HQ, HKV, D, D, beta=scale)(q, k, v, return_lse=True)
    logits = scale * q @ k.repeat_interleave(HQ // HKV, dim=1).transpose(-1, -2)
    logits = logits.masked_fill(~(i[None, :] <= i[:, None]), float("-inf"))
    assert torch.allclose(lse, torch.logsumexp(logits, dim=-1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("mixer", [
    ovq.LinearAttention(feature_map="elu1", normalize=True, chunk=16),
    ovq.OVQAttention(capacity=24, chunk=16, beta=0.5),
    ovq.VQAttention(chunk=16, beta=0.5),
], ids=repr)
def test_layers_match_the_references(mixer, qkv):
    q, k, v = (x.double() for x in qkv)
    codebooks = None
    if isinstance(mixer, ovq.VQAttention):
        codebooks = torch.nn.functional.normalize(torch.randn(HKV, 8, D, dtype=torch.float64),
                                                  dim=-1)
    layer = otorch.Attention(mixer, B, HQ, HKV, D, D, dtype=torch.float64, codebooks=codebooks)
    o = layer(q, k, v)
    for b in range(B):
        for h in range(HQ):
            g = h // (HQ // HKV)
            cb = None if codebooks is None else codebooks[g].numpy()
            ref = mixer._impl._reference(q[b, h].numpy(), k[b, g].numpy(), v[b, g].numpy(), cb)
            assert rel_err(o[b, h].numpy(), ref) < 1e-10


def test_compile_fullgraph_forward_step_absorb(qkv):
    q, k, v = qkv

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            # (normalize_qk would be compiled by inductor, to other rounding than eager's)
            self.attn = otorch.OVQAttention(B, HQ, HKV, D, D, capacity=32, chunk=16)

        def forward(self, q, k, v):
            self.attn.absorb(k[:, :, :32], v[:, :, :32])
            o = self.attn(q[:, :, 32:-1], k[:, :, 32:-1], v[:, :, 32:-1])
            o_t = self.attn.step(q[:, :, -1].contiguous(), k[:, :, -1].contiguous(),
                                 v[:, :, -1].contiguous())
            return o * 2, o_t

    eager, compiled = Block(), Block()
    o_e, t_e = eager(q, k, v)
    torch._dynamo.reset()
    o_c, t_c = torch.compile(compiled, fullgraph=True)(q, k, v)
    assert torch.equal(o_c, o_e) and torch.equal(t_c, t_e)
    assert compiled.attn.layer.to_bytes() == eager.attn.layer.to_bytes()


def test_normalize_qk(qkv):
    q, k, v = qkv
    layer = otorch.OVQAttention(B, HQ, HKV, D, D, capacity=32, chunk=16, normalize_qk=True)
    plain = otorch.OVQAttention(B, HQ, HKV, D, D, capacity=32, chunk=16)
    assert torch.equal(layer(q, k, v), plain(F.normalize(q, dim=-1), F.normalize(k, dim=-1), v))


def test_backward_raises_a_clear_error(qkv):
    q, k, v = qkv
    layer = otorch.SelfAttention(B, HQ, HKV, D, D)
    qg = q.clone().requires_grad_()
    out = layer(qg, k, v)
    with pytest.raises(RuntimeError, match="forward only"):
        out.sum().backward()
    with torch.no_grad():
        assert not layer(qg, k, v).requires_grad


def test_state_dict_round_trips_the_states(qkv, tmp_path):
    q, k, v = qkv
    layer = otorch.OVQAttention(B, HQ, HKV, D, D, capacity=16, chunk=8)
    layer(q, k, v)
    path = tmp_path / "layer.pt"
    torch.save(layer.state_dict(), path)
    other = otorch.OVQAttention(B, HQ, HKV, D, D, capacity=16, chunk=8)
    other.load_state_dict(torch.load(path))
    assert other.layer.to_bytes() == layer.layer.to_bytes()
    step = [x[:, :, 0].contiguous() for x in (q, k, v)]
    assert torch.equal(layer.step(*step), other.step(*step))
    clone = copy.deepcopy(layer.layer)
    assert clone.to_bytes() == layer.layer.to_bytes()
