"""ovq over torch tensors: zero-copy calls, 16-bit tensors, the ovq.torch ops and layers against
PyTorch's scaled_dot_product_attention and the library's references, torch.compile."""

import copy
import math
import warnings

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


class _Sub(torch.Tensor):
    """A tensor subclass: read through the tensor's accessors, not the exchange table."""


def test_every_kind_of_tensor_is_read_as_its_values_or_refused():
    # Plain tensors and parameters are read through PyTorch's DLPack exchange table, everything
    # else through the tensor's accessors: the same values either way, and what neither can
    # read in place (a lazily negated view, a ZeroTensor, a nested tensor) is refused with the
    # state left as it was.
    assert ovq._ovq._torch_exchange_table() == hasattr(torch.Tensor,
                                                       "__dlpack_c_exchange_api__")
    mixer = ovq.SelfAttention(beta=0.5)
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(T, D, generator=g) for _ in range(3))
    expected = mixer.forward(mixer.make_state(D, D), q.numpy(), k.numpy(), v.numpy())
    wide = torch.randn(3, T, D, generator=g)
    wide[1] = q  # a view with a storage offset
    with torch.inference_mode():
        q_inference = q.clone()
    for name, qx in [("tensor", q), ("offset view", wide[1]), ("parameter", torch.nn.Parameter(q)),
                     ("subclass", q.as_subclass(_Sub)),
                     ("requires grad", q.clone().requires_grad_(True)),
                     ("inference", q_inference)]:
        got = mixer.forward(mixer.make_state(D, D), qx, k, v)
        assert isinstance(got, torch.Tensor) and got.dtype == torch.float32, name
        assert np.array_equal(got.detach().numpy(), expected), name

    # One element: its layout passes for C-contiguous, so only the negation flag tells.
    tiny = mixer.make_state(1, 1)
    negated_one = torch.randn(1, 1, dtype=torch.complex64, generator=g).conj().imag
    assert negated_one.is_neg()
    with pytest.raises(ValueError, match="lazily negated"):
        mixer.forward(tiny, negated_one, negated_one.resolve_neg(), negated_one.resolve_neg())
    assert tiny.t == 0
    state = mixer.make_state(D, D)
    z = torch.randn(T, D, dtype=torch.complex64, generator=g)
    negated = z.conj().imag  # a real tensor whose values are its memory's negation
    assert negated.is_neg()
    with pytest.raises(ValueError, match="lazily negated"):
        mixer.forward(state, negated, k, v)
    assert np.array_equal(mixer.forward(mixer.make_state(D, D), negated.resolve_neg(), k, v),
                          mixer.forward(mixer.make_state(D, D), -z.imag.numpy(), k.numpy(),
                                        v.numpy()))
    misaligned = torch.frombuffer(bytearray(T * D * 4 + 1), dtype=torch.float32, offset=1,
                                  count=T * D).reshape(T, D)
    misaligned.copy_(q)
    with pytest.raises(ValueError, match="not a multiple of 4 bytes"):
        mixer.forward(state, misaligned, k, v)
    with pytest.raises(ValueError, match="ZeroTensor"):
        mixer.forward(state, torch._efficientzerotensor((T, D)), k, v)
    with warnings.catch_warnings():  # (nested tensors warn that they are a prototype)
        warnings.simplefilter("ignore")
        nested = torch.nested.as_nested_tensor([q[:5], q[5:12]])
    with pytest.raises(TypeError, match="nested"):
        mixer.forward(state, nested, k, v)
    assert state.t == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_step_outputs_made_by_the_extension(dtype):
    # A step without out= gets its output from the extension, as the inputs' kind: a tensor
    # for tensors (every element type), a NumPy array for arrays; the same values as a step
    # into a given output. Bad inputs are reported before anything is made.
    mixer = ovq.OVQAttention(capacity=16, chunk=8, beta=0.5)
    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(4, 3, D, generator=g).to(dtype) for _ in range(3))
    layer = ovq.MultiHead(mixer, 4, 6, 3, D, D, dtype=dtype)
    given = copy.copy(layer)
    state, given_state = mixer.make_state(D, D, dtype=dtype), mixer.make_state(D, D, dtype=dtype)
    for t in range(20):
        qt, kt, vt = (x + t for x in (q, k, v))
        qh = torch.cat([qt, qt], dim=1)
        made = layer.step(qh, kt, vt)
        assert type(made) is torch.Tensor and made.dtype == dtype
        assert made.shape == (4, 6, D) and made.is_contiguous()
        out = torch.full((4, 6, D), float("nan"), dtype=dtype)
        assert given.step(qh, kt, vt, out=out) is out
        assert torch.equal(made, out)
        one = mixer.step(state, qt[0, 0], kt[0, 0], vt[0, 0])
        assert type(one) is torch.Tensor and one.dtype == dtype and one.shape == (D,)
        out1 = torch.empty(D, dtype=dtype)
        assert mixer.step(given_state, qt[0, 0], kt[0, 0], vt[0, 0], out=out1) is out1
        assert torch.equal(one, out1)
    assert layer.to_bytes() == given.to_bytes()
    if dtype != torch.bfloat16:
        name = str(dtype)[6:]
        arrays = [x.numpy() for x in (torch.cat([q, q], dim=1), k, v)]
        made = layer.step(*arrays)
        assert type(made) is np.ndarray and made.dtype == name and made.shape == (4, 6, D)
        one = mixer.step(state, arrays[0][0, 0], arrays[1][0, 0], arrays[2][0, 0])
        assert type(one) is np.ndarray and one.dtype == name and one.shape == (D,)
    before = layer.to_bytes()
    with pytest.raises(ValueError, match="q has shape"):
        layer.step(q[0], k, v)
    with pytest.raises(TypeError, match="k has dtype"):
        layer.step(torch.cat([q, q], dim=1), k.to(torch.float64 if dtype != torch.float64
                                                   else torch.float32), v)
    with pytest.raises(ValueError, match="v has shape"):
        mixer.step(state, q[0, 0], k[0, 0], v[0])
    assert layer.to_bytes() == before


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
    step = layer.step(qg[:, :, 0], k[:, :, 0].contiguous(), v[:, :, 0].contiguous())
    with pytest.raises(RuntimeError, match="forward only"):
        step.sum().backward()


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


# ---- torch.ops.ovq.*: the C++ operators (ovq._torch_ops), and the Python ones ----

def _op_layers(dtype=torch.float32):
    """Two identical layers of each mixer: one driven by its methods, one by torch.ops.ovq."""
    g = torch.Generator().manual_seed(5)
    codebooks = F.normalize(torch.randn(HKV, 8, D, generator=g), dim=-1).to(dtype)
    makers = [
        lambda: otorch.SelfAttention(B, HQ, HKV, D, D, dtype=dtype, window=40),
        lambda: otorch.LinearAttention(B, HQ, HKV, D, D, dtype=dtype, chunk=16),
        lambda: otorch.VQAttention(B, HQ, HKV, D, D, dtype=dtype, codebooks=codebooks),
        lambda: otorch.OVQAttention(B, HQ, HKV, D, D, dtype=dtype, capacity=32, chunk=16),
    ]
    return [(make(), make()) for make in makers]


def test_ops_are_the_cpp_operators_where_built_with_this_pytorch():
    # scripts/test builds with PyTorch importable and sets OVQ_REQUIRE_TORCH_OPS=1: there the
    # C++ operators must be what ovq.torch uses.
    import importlib.util
    import os

    if os.environ.get("OVQ_TORCH_OPS") == "python":
        pytest.skip("OVQ_TORCH_OPS=python asks for the Python ops")
    built = importlib.util.find_spec("ovq._torch_ops_build") is not None
    if not built and os.environ.get("OVQ_REQUIRE_TORCH_OPS") != "1":
        pytest.skip("ovq was built where PyTorch was not importable (pip's build isolation)")
    assert built and otorch.NATIVE_OPS
    import ovq._torch_ops_build as build

    assert build.torch_version == torch.__version__


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_ops_give_the_methods_bits_and_states(qkv, dtype):
    q, k, v = (x.to(dtype) for x in qkv)

    def span(a, b):  # tokens a..b-1 of q, k and v, contiguous as the ops want them
        return [x[:, :, a:b].contiguous() for x in (q, k, v)]

    for by_method, by_op in _op_layers(dtype):
        h = by_op.handle
        _, k0, v0 = span(0, 20)
        by_method.absorb(k0, v0)
        torch.ops.ovq.absorb(h, k0, v0, 0)
        x = span(20, 60)
        assert torch.equal(torch.ops.ovq.forward(h, *x, 2), by_method(*x))
        x = span(60, 90)
        if not isinstance(by_op.mixer, ovq.LinearAttention):
            o, lse = torch.ops.ovq.forward_lse(h, *x, 1)
            o_m, lse_m = by_method(*x, return_lse=True)
            assert torch.equal(o, o_m) and torch.equal(lse, lse_m)
            assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        else:
            with pytest.raises(ValueError, match="log-sum-exp"):
                torch.ops.ovq.forward_lse(h, *x, 1)
            assert torch.equal(torch.ops.ovq.forward(h, *x, 1), by_method(*x))
        for t in range(90, T):
            step = [x[:, :, t].contiguous() for x in (q, k, v)]
            assert torch.equal(torch.ops.ovq.step(h, *step, 0), by_method.step(*step))
        assert by_op.layer.to_bytes() == by_method.layer.to_bytes()


def test_ops_refuse_bad_input_by_name_and_leave_the_states(qkv):
    q, k, v = qkv
    layer = otorch.OVQAttention(B, HQ, HKV, D, D, capacity=32, chunk=16)
    h = layer.handle
    layer(q[:, :, :40], k[:, :, :40], v[:, :, :40])
    before = layer.layer.to_bytes()
    s = [x[:, :, 0].contiguous() for x in (q, k, v)]
    bad = [
        (TypeError, "q has dtype float64", torch.ops.ovq.forward, (h, q.double(), k, v, 0)),
        (ValueError, r"k has shape \(2, 1, 96, 16\), expected \(2, 2, 96",
         torch.ops.ovq.forward, (h, q, k[:, :1].contiguous(), v, 0)),
        (ValueError, "v has shape", torch.ops.ovq.forward, (h, q, k, v[0], 0)),
        (ValueError, "not C-contiguous", torch.ops.ovq.forward, (h, q.transpose(2, 3), k, v, 0)),
        (ValueError, "threads = -1", torch.ops.ovq.forward, (h, q, k, v, -1)),
        (TypeError, "layout", torch.ops.ovq.forward, (h, q.to_sparse(), k, v, 0)),
        (TypeError, "handle", torch.ops.ovq.forward, (h.double(), q, k, v, 0)),
        (TypeError, "handle", torch.ops.ovq.step, (torch.tensor([1, 2]), *s, 0)),
        (ValueError, r"q has shape \(2, 4, 16\), expected 4 dimensions",
         torch.ops.ovq.forward, (h, *s, 0)),
        (ValueError, "expected 3 dimensions", torch.ops.ovq.step, (h, q, k, v, 0)),
        (ValueError, "step: k has shape", torch.ops.ovq.step, (h, s[0], s[1][:1], s[2], 0)),
        (TypeError, "k has dtype (torch.)?int64", torch.ops.ovq.absorb, (h, k.long(), v, 0)),
        (ValueError, "absorb: V has shape", torch.ops.ovq.absorb,
         (h, k, v[:, :, :5].contiguous(), 0)),
    ]
    for error, match, op, args in bad:
        with pytest.raises(error, match=match):
            op(*args)
        assert layer.layer.to_bytes() == before, match
    # (A lazily negated view reaches the op resolved: PyTorch's dispatcher resolves it first.)
    a, b = (otorch.SelfAttention(B, HQ, HKV, D, D) for _ in range(2))
    assert torch.equal(torch.ops.ovq.forward(a.handle, q, k, v._neg_view(), 0), b(q, k, -v))


def test_ops_on_a_freed_layer_raise():
    layer = otorch.SelfAttention(B, HQ, HKV, D, D)
    handle = layer.handle.clone()
    del layer
    import gc

    gc.collect()
    s = [torch.randn(B, h, D) for h in (HQ, HKV, HKV)]
    with pytest.raises(RuntimeError, match="no layer has handle"):
        torch.ops.ovq.step(handle, *s, 0)


def test_ops_are_forward_only(qkv):
    q, k, v = qkv
    layer = otorch.SelfAttention(B, HQ, HKV, D, D)
    qg = q.clone().requires_grad_()
    for out in (torch.ops.ovq.forward(layer.handle, qg, k, v, 0),
                torch.ops.ovq.forward_lse(layer.handle, qg, k, v, 0)[1],
                torch.ops.ovq.step(layer.handle, qg[:, :, 0].contiguous(), k[:, :, 0].contiguous(),
                                   v[:, :, 0].contiguous(), 0)):
        assert out.requires_grad
        with pytest.raises(RuntimeError, match="forward only|no autograd formula"):
            out.sum().backward()
    with torch.no_grad():
        assert not torch.ops.ovq.forward(layer.handle, qg, k, v, 0).requires_grad


def test_ops_from_threads_at_once(qkv):
    # Each thread drives its own layer through the ops (which run without the GIL); the results
    # are those of the same calls one after another.
    import threading

    chunks = [[x[:, :, t:t + 8].contiguous() for x in qkv] for t in range(0, T, 8)]
    layers = [otorch.OVQAttention(B, HQ, HKV, D, D, capacity=32, chunk=16) for _ in range(4)]
    outs = [[] for _ in layers]

    def run(i):
        try:
            for chunk in chunks:
                outs[i].append(torch.ops.ovq.forward(layers[i].handle, *chunk, 1))
        except Exception as e:  # noqa: BLE001  (reported below, in the test's thread)
            outs[i].append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(layers))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    alone = otorch.OVQAttention(B, HQ, HKV, D, D, capacity=32, chunk=16)
    expected = [alone(*chunk) for chunk in chunks]
    for got in outs:
        assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))


_PYTHON_OPS_CHECK = """
import torch, ovq, ovq.torch as otorch
assert not otorch.NATIVE_OPS
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(2, h, 24, 16, generator=g) for h in (4, 2, 2))
a = otorch.OVQAttention(2, 4, 2, 16, 16, capacity=16, chunk=8)
b = otorch.OVQAttention(2, 4, 2, 16, 16, capacity=16, chunk=8)
assert torch.equal(torch.ops.ovq.forward(b.handle, q, k, v, 0), a(q, k, v))
s = [x[:, :, 0].contiguous() for x in (q, k, v)]
assert torch.equal(torch.ops.ovq.step(b.handle, *s, 0), a.step(*s))
assert a.layer.to_bytes() == b.layer.to_bytes()
try:
    torch.ops.ovq.forward(b.handle, q.double(), k, v, 0)
    raise SystemExit("no error")
except TypeError as e:
    assert "q has dtype float64" in str(e), e
try:
    torch.ops.ovq.step(b.handle.double(), *s, 0)
    raise SystemExit("no error")
except TypeError as e:
    assert "handle is not a layer's handle" in str(e), e
out = torch.ops.ovq.step(b.handle, s[0].clone().requires_grad_(), s[1], s[2], 0)
try:
    out.sum().backward()
    raise SystemExit("no error")
except RuntimeError:
    pass
a.step(*s)  # (the step b took above)
f = torch.compile(lambda q, k, v: b.step(q, k, v) * 2, fullgraph=True)
assert torch.equal(f(*s), a.step(*s) * 2)
print("ok")
"""


def test_python_ops_give_the_same_results():
    # The ops registered in Python (OVQ_TORCH_OPS=python), in a process of their own: the dispatcher
    # holds one registration of torch.ops.ovq per process.
    import os
    import subprocess
    import sys

    env = dict(os.environ, OVQ_TORCH_OPS="python")
    run = subprocess.run([sys.executable, "-c", _PYTHON_OPS_CHECK], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr
    # The op tests of this file, through the Python ops.
    tests = "ops and not cpp_operators and not python_ops"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", tests, __file__],
        env=env, capture_output=True, text=True, timeout=600,
        cwd=os.path.dirname(os.path.abspath(__file__)))
    assert run.returncode == 0, run.stdout[-3000:]


def test_ops_fake_implementations_match_the_kernels(qkv):
    # The Meta kernels (what torch.compile traces with) against the real ones: shapes, strides
    # and dtypes of every output, and the schemas' mutation annotations.
    q, k, v = qkv
    s = [x[:, :, 0].contiguous() for x in (q, k, v)]
    for dtype in (torch.float32, torch.float64):
        layer = otorch.OVQAttention(B, HQ, HKV, D, D, capacity=32, chunk=16, dtype=dtype)
        x = [t.to(dtype) for t in (q, k, v)]
        for op, args in ((torch.ops.ovq.forward.default, (layer.handle, *x, 0)),
                         (torch.ops.ovq.forward_lse.default, (layer.handle, *x, 0)),
                         (torch.ops.ovq.step.default, (layer.handle, *(t.to(dtype) for t in s), 0)),
                         (torch.ops.ovq.absorb.default, (layer.handle, x[1], x[2], 0))):
            torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_copies_of_a_layer_module_drive_their_own_states(qkv):
    import pickle

    q, k, v = qkv
    layer = otorch.OVQAttention(B, HQ, HKV, D, D, capacity=32, chunk=16)
    layer(q[:, :, :32].contiguous(), k[:, :, :32].contiguous(), v[:, :, :32].contiguous())
    before = layer.layer.to_bytes()
    x = [t[:, :, 32:64].contiguous() for t in (q, k, v)]
    for other in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert int(other.handle) != int(layer.handle)
        o = torch.ops.ovq.forward(other.handle, *x, 0)
        assert layer.layer.to_bytes() == before  # the original's states are untouched
        reference = otorch.OVQAttention(B, HQ, HKV, D, D, capacity=32, chunk=16)
        reference.load_state_dict(layer.state_dict())
        assert torch.equal(o, reference(*x))


def test_ops_on_one_layer_from_threads_and_freed_while_running(qkv):
    # Calls on one layer from several threads take turns (each sees whole states); a layer freed
    # while a call runs outlives that call (the destructor waits for it).
    import threading
    import time

    chunks = [[x[:, :, t:t + 8].contiguous() for x in qkv] for t in range(0, T, 8)]
    layer = otorch.SelfAttention(B, HQ, HKV, D, D)
    errors = []

    def run():
        try:
            for chunk in chunks:
                torch.ops.ovq.forward(layer.handle, *chunk, 1)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors and layer.layer.state(0, 0).t == 3 * T

    big = otorch.SelfAttention(1, 8, 8, 64, 64, threads=1)
    handle = big.handle.clone()
    g = torch.Generator().manual_seed(1)
    x = [torch.randn(1, 8, 2048, 64, generator=g) for _ in range(3)]
    done, started = [], threading.Event()

    def long_call():
        started.set()
        try:
            done.append(torch.ops.ovq.forward(handle, *x, 1))
        except RuntimeError as e:  # (the layer was gone before the call began: also correct)
            done.append(e)

    th = threading.Thread(target=long_call)
    th.start()
    started.wait()
    time.sleep(0.01)
    del big
    import gc

    gc.collect()
    th.join()
    assert len(done) == 1
    assert (isinstance(done[0], torch.Tensor) and done[0].shape == (1, 8, 2048, 64)) or \
        "no layer has handle" in str(done[0])
    with pytest.raises(RuntimeError, match="no layer has handle"):
        torch.ops.ovq.forward(handle, *x, 1)
