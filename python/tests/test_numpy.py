"""ovq over NumPy arrays: the four mixers against the library's double references, every way of
cutting a stream, states as Python objects, and every kind of bad input."""

import copy
import pickle
import threading

import numpy as np
import pytest

import ovq
from conftest import rel_err, unit_rows

T, DK, DV = 150, 12, 8


def mixers():
    return [
        ovq.SelfAttention(beta=0.5),
        ovq.SelfAttention(beta=0.5, window=17, chunk=32),
        ovq.LinearAttention(feature_map="elu1", normalize=True, decay=0.98, chunk=16),
        ovq.OVQAttention(capacity=24, chunk=16, beta=2.0),
        ovq.OVQAttention(capacity=24, chunk=16, growth=ovq.Growth.saturating()),
        ovq.OVQAttention(capacity=24, chunk=16, growth=ovq.Growth.linear(0.5),
                         seeding=ovq.Seeding.random(7), rate=ovq.UpdateRate.constant(0.3),
                         renormalize=True),
        ovq.VQAttention(beta=1.5, chunk=16),
    ]


def inputs(rng, dtype, t=T):
    q = rng.standard_normal((t, DK)).astype(dtype)
    k = unit_rows(rng, t, DK, dtype)
    v = rng.standard_normal((t, DV)).astype(dtype)
    return q, k, v


def make(mixer, dtype, rng=None):
    if isinstance(mixer, ovq.VQAttention):
        codebook = unit_rows(np.random.default_rng(99), 10, DK, dtype)
        return mixer.make_state(codebook, DV), codebook
    return mixer.make_state(DK, DV, dtype=dtype), None


@pytest.mark.parametrize("mixer", mixers(), ids=repr)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_forward_matches_the_reference(mixer, dtype, rng):
    q, k, v = inputs(rng, dtype)
    state, codebook = make(mixer, dtype)
    o = mixer.forward(state, q, k, v)
    assert o.dtype == dtype and o.shape == (T, DV)
    cb = None if codebook is None else codebook.astype(np.float64)
    ref = mixer._impl._reference(q.astype(np.float64), k.astype(np.float64),
                                 v.astype(np.float64), cb)
    assert rel_err(o, ref) <= (1e-4 if dtype == np.float32 else 1e-10)
    assert state.t == T


@pytest.mark.parametrize("mixer", mixers(), ids=repr)
def test_streaming_equals_chunked_bitwise(mixer, rng):
    q, k, v = inputs(rng, np.float32)
    whole, _ = make(mixer, np.float32)
    o_whole = mixer.forward(whole, q, k, v)
    cut, _ = make(mixer, np.float32)
    parts, pos, n = [], 0, 5
    while pos < T:
        m = min(n, T - pos)
        parts.append(mixer.forward(cut, q[pos:pos + m], k[pos:pos + m], v[pos:pos + m]))
        pos, n = pos + m, n % 19 + 3
    steps, _ = make(mixer, np.float32)
    o_steps = np.stack([mixer.step(steps, q[i], k[i], v[i]) for i in range(T)])
    assert np.array_equal(np.concatenate(parts), o_whole)
    assert np.array_equal(o_steps, o_whole)
    assert cut == whole and steps == whole
    absorbed, _ = make(mixer, np.float32)
    mixer.absorb(absorbed, k, v)
    assert absorbed == whole


@pytest.mark.parametrize("mixer", mixers(), ids=repr)
def test_states_copy_pickle_and_files(mixer, rng, tmp_path):
    q, k, v = inputs(rng, np.float32)
    state, _ = make(mixer, np.float32)
    mixer.forward(state, q[:100], k[:100], v[:100])
    snap = copy.copy(state)
    back = pickle.loads(pickle.dumps(state))
    assert back == state and snap == state and back.to_bytes() == state.to_bytes()
    rest = mixer.forward(state, q[100:], k[100:], v[100:])
    assert snap != state
    assert np.array_equal(mixer.forward(back, q[100:], k[100:], v[100:]), rest)
    path = tmp_path / "state.ovq"
    ovq.save_state(path, state)
    loaded = ovq.load_state(path, mixer)
    assert loaded == state and loaded.dtype == "float32"
    assert loaded.bytes == state.bytes > 0
    state.reset()
    assert state.t == 0


def test_state_views_are_read_only_and_live(rng):
    mixer = ovq.OVQAttention(capacity=16, chunk=8)
    state = mixer.make_state(DK, DV)
    q, k, v = inputs(rng, np.float32, 64)
    mixer.forward(state, q, k, v)
    keys, counts = state.keys, state.counts
    assert keys.shape == (state.n, DK) and counts.shape == (state.n,)
    assert counts.dtype == np.int64 and counts.sum() == state.t - state.pending
    assert not keys.flags.writeable and not counts.flags.writeable
    with pytest.raises(ValueError):
        keys[0, 0] = 1.0
    before = keys.copy()
    mixer.forward(state, q, k, v)
    assert not np.array_equal(keys, before)  # a view of the dictionary's rows
    del state
    assert np.isfinite(keys).all()  # the view keeps the state alive

    self_state = ovq.SelfAttention().make_state(DK, DV)
    ovq.SelfAttention().forward(self_state, q, k, v)
    assert np.array_equal(self_state.keys, k) and np.array_equal(self_state.values, v)
    lin = ovq.LinearAttention(chunk=16)
    ls = lin.make_state(DK, DV)
    lin.forward(ls, q, k, v)
    assert ls.kv.shape == (DK, DV) and ls.k_sum.shape == (DK,)
    assert np.allclose(ls.kv, k.astype(np.float64).T @ v, rtol=1e-4, atol=1e-4)


def test_float16_inputs(rng):
    mixer = ovq.OVQAttention(capacity=16, chunk=8)
    q, k, v = (x.astype(np.float16) for x in inputs(rng, np.float32, 64))
    s16 = mixer.make_state(DK, DV, dtype="float16")
    o16 = mixer.forward(s16, q, k, v)
    assert o16.dtype == np.float16
    s32 = mixer.make_state(DK, DV)
    o32 = mixer.forward(s32, *(x.astype(np.float32) for x in (q, k, v)))
    assert rel_err(o16, o32) < 1e-2


def test_return_lse_and_merge(rng):
    half = 64
    q, k, v = inputs(rng, np.float64, 2 * half)
    causal = ovq.SelfAttention()
    o_full, lse_full = causal.forward(causal.make_state(DK, DV, "float64"), q, k, v,
                                      return_lse=True)
    assert lse_full.shape == (2 * half,) and lse_full.dtype == np.float64
    # lse of query 0 sees key 0 only.
    assert np.isclose(lse_full[0], q[0] @ k[0])
    noncausal = ovq.SelfAttention(causal=False)
    o_a, lse_a = noncausal.forward(noncausal.make_state(DK, DV, "float64"), q[half:], k[:half],
                                   v[:half], return_lse=True)
    o_b, lse_b = causal.forward(causal.make_state(DK, DV, "float64"), q[half:], k[half:],
                                v[half:], return_lse=True)
    o, lse = ovq.merge(o_a, lse_a, o_b, lse_b)
    assert rel_err(o, o_full[half:]) < 1e-12
    assert np.allclose(lse, lse_full[half:], rtol=0, atol=1e-12)
    assert not np.array_equal(o_a, o)  # merge returns new arrays
    with pytest.raises(ValueError, match="linear attention has no softmax"):
        lin = ovq.LinearAttention()
        lin.forward(lin.make_state(DK, DV, "float64"), q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="o_b"):
        ovq.merge(o_a, lse_a, o_b[:, :3].copy(), lse_b)


def test_linear_chain(rng):
    mixer = ovq.LinearAttention(decay=0.95, chunk=16)
    q, k, v = inputs(rng, np.float64, 96)
    one = mixer.make_state(DK, DV, "float64")
    mixer.absorb(one, k, v)
    a = mixer.make_state(DK, DV, "float64")
    mixer.absorb(a, k[:48], v[:48])
    b = mixer.make_state(DK, DV, "float64")
    mixer.absorb(b, k[48:], v[48:])
    chained = mixer.chain(a, b)
    assert chained.t == 96
    assert np.allclose(chained.kv, one.kv, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="pending rows"):
        c = mixer.make_state(DK, DV, "float64")
        mixer.absorb(c, k[:5], v[:5])
        mixer.chain(c, b)


def test_multi_head_grouped_queries(rng):
    mixer = ovq.OVQAttention(capacity=16, chunk=8)
    B, HQ, HKV, t = 2, 4, 2, 40
    layer = ovq.MultiHead(mixer, B, HQ, HKV, DK, DV)
    q = rng.standard_normal((B, HQ, t, DK)).astype(np.float32)
    k = rng.standard_normal((B, HKV, t, DK)).astype(np.float32)
    v = rng.standard_normal((B, HKV, t, DV)).astype(np.float32)
    o, lse = layer.forward(q, k, v, return_lse=True)
    assert o.shape == (B, HQ, t, DV) and lse.shape == (B, HQ, t)
    for b in range(B):
        for h in range(HQ):
            g = h // (HQ // HKV)
            s = mixer.make_state(DK, DV)
            o1, l1 = mixer.forward(s, q[b, h], k[b, g], v[b, g], return_lse=True)
            assert np.array_equal(o[b, h], o1) and np.array_equal(lse[b, h], l1)
            assert s == layer.state(b, g)  # every query head of a group writes the same state
    again = pickle.loads(pickle.dumps(layer))
    q0, k0, v0 = (np.ascontiguousarray(x[:, :, 0]) for x in (q, k, v))
    step_a = layer.step(q0, k0, v0)
    step_b = again.step(q0, k0, v0)
    assert np.array_equal(step_a, step_b)
    with pytest.raises(ValueError, match=r"q has shape \(1, 8, 12\), expected \(2, 4, \.\.\.\)"):
        layer.step(np.ascontiguousarray(q0.reshape(1, 8, DK)), k0, v0)  # B Hq rows, other split
    assert layer.bytes > 0
    codebooks = np.stack([unit_rows(rng, 6, DK, np.float32) for _ in range(HKV)])
    vq_layer = ovq.MultiHead(ovq.VQAttention(), B, HQ, codebooks=codebooks, dv=DV)
    assert vq_layer.forward(q, k, v).shape == (B, HQ, t, DV)
    vq_again = pickle.loads(pickle.dumps(vq_layer))
    assert vq_again.to_bytes() == vq_layer.to_bytes()


def test_fit_codebook(rng):
    keys = np.concatenate([rng.standard_normal((50, 4)) + c for c in (0.0, 10.0, 20.0)])
    codebook = ovq.fit_codebook(keys, 3, seed=1)
    assert codebook.shape == (3, 4)
    assert sorted(np.round(codebook.mean(axis=1) / 10)) == [0, 1, 2]


def test_threads_and_the_gil(rng):
    mixer = ovq.SelfAttention()
    q, k, v = inputs(rng, np.float32, 400)
    expected = mixer.forward(mixer.make_state(DK, DV), q, k, v)
    assert np.array_equal(mixer.forward(mixer.make_state(DK, DV), q, k, v, threads=1), expected)
    results, errors = [None] * 4, []

    def run(i):
        try:
            results[i] = mixer.forward(mixer.make_state(DK, DV), q, k, v, threads=1)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    workers = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors and all(np.array_equal(r, expected) for r in results)
    # One state shared by threads: calls take turns, every token lands once.
    shared = mixer.make_state(DK, DV)
    workers = [threading.Thread(target=mixer.forward, args=(shared, q, k, v)) for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert shared.t == 3 * 400
    with pytest.raises(ValueError, match="threads"):
        mixer.forward(mixer.make_state(DK, DV), q, k, v, threads=-1)


BAD = [
    ("q", lambda q, k, v: (q.astype(np.float64), k, v), TypeError, "q has dtype float64"),
    ("q", lambda q, k, v: (q[:, ::2], k, v), ValueError, "not C-contiguous"),
    ("k", lambda q, k, v: (q, k.T.copy().T, v), ValueError, "k of shape"),
    ("q", lambda q, k, v: (q[None], k, v), ValueError, "q has shape"),
    ("v", lambda q, k, v: (q, k, v.reshape(-1)), ValueError, "v has shape"),
    ("q", lambda q, k, v: (q.tolist(), k, v), TypeError, "q is a list"),
    ("k", lambda q, k, v: (q, k[:5], v), ValueError, "rows"),
    ("v", lambda q, k, v: (q, k, np.where(np.arange(v.size).reshape(v.shape) == 7, np.nan,
                                          v).astype(np.float32)), ValueError, "V"),
    ("q", lambda q, k, v: (q.astype(np.int32), k, v), TypeError, "int32"),
    ("k", lambda q, k, v: (q, _misaligned(k), v), ValueError, "not a multiple of 4 bytes"),
]


def _misaligned(a):
    """The values of `a` in an array that starts one byte past an aligned address."""
    buffer = bytearray(a.nbytes + 1)
    b = np.frombuffer(buffer, dtype=a.dtype, count=a.size, offset=1).reshape(a.shape)
    b[...] = a
    assert not b.flags.aligned
    return b


@pytest.mark.parametrize("name,bad,error,text", BAD, ids=[b[3] for b in BAD])
@pytest.mark.parametrize("mixer", mixers()[::2], ids=repr)
def test_bad_input_raises_and_leaves_the_state(mixer, name, bad, error, text, rng):
    q, k, v = inputs(rng, np.float32, 20)
    state, _ = make(mixer, np.float32)
    mixer.forward(state, q, k, v)
    before = copy.copy(state)
    with pytest.raises(error, match=text):
        mixer.forward(state, *bad(q, k, v))
    assert state == before


def test_bad_outputs_and_options(rng):
    mixer = ovq.SelfAttention()
    q, k, v = inputs(rng, np.float32, 10)
    state = mixer.make_state(DK, DV)
    out = np.empty((10, DV), np.float32)
    out.flags.writeable = False
    with pytest.raises((TypeError, ValueError)):
        mixer.forward(state, q, k, v, out=out)
    with pytest.raises(ValueError, match="overlaps"):
        vv = v.copy()
        mixer.forward(state, q, k, vv, out=vv)
    with pytest.raises(ValueError, match="O has"):
        mixer.forward(state, q, k, v, out=np.empty((10, DV + 1), np.float32))
    with pytest.raises(ValueError, match="out starts at an address"):
        mixer.forward(state, q, k, v, out=_misaligned(np.empty((10, DV), np.float32)))
    assert state.t == 0
    with pytest.raises(TypeError, match="unexpected keyword argument 'windw'"):
        ovq.SelfAttention(windw=3)
    with pytest.raises(ValueError, match="window"):
        ovq.SelfAttention(window=-1)
    with pytest.raises(TypeError, match="chunk must be an int"):
        ovq.SelfAttention(chunk=2.5)
    with pytest.raises(ValueError, match="feature_map"):
        ovq.LinearAttention(feature_map="tanh")
    with pytest.raises(TypeError, match="dtype"):
        mixer.make_state(DK, DV, dtype="int8")
    with pytest.raises(TypeError, match="expected an ovq state"):
        mixer.forward(None, q, k, v)
    with pytest.raises(ValueError):
        mixer.load_state(b"not a state file")
    other = ovq.OVQAttention(capacity=8)
    with pytest.raises(ValueError, match="mixer kind"):
        other.load_state(state.to_bytes())
    with pytest.raises(ValueError, match="capacity"):
        ovq.OVQAttention(capacity=9).forward(other.make_state(DK, DV), q, k, v)


def test_no_input_crashes(rng):
    """Random shapes, ranks, dtypes, layouts and values: a result or TypeError / ValueError."""
    shapes = [(0, DK), (1, DK), (7, DK), (7, DK + 1), (7,), (DK,), (3, 7, DK), (), (7, 0)]
    dtypes = [np.float32, np.float64, np.float16, np.int64, np.bool_]
    specials = [0.0, np.nan, np.inf, -np.inf, 6e4, -1e-7]

    def array():
        shape = shapes[rng.integers(len(shapes))]
        a = rng.standard_normal(shape).astype(dtypes[rng.integers(len(dtypes))])
        if a.size and a.dtype.kind == "f" and rng.random() < 0.3:
            a.flat[rng.integers(a.size)] = specials[rng.integers(len(specials))]
        if a.ndim == 2 and rng.random() < 0.2:
            a = np.asfortranarray(a)
        return a

    for mixer in mixers():
        for dtype in (np.float32, np.float64):
            state, _ = make(mixer, dtype)
            for _ in range(60):
                q, k, v = array(), array(), array()
                call = rng.integers(3)
                try:
                    if call == 0:
                        mixer.forward(state, q, k, v, return_lse=bool(rng.integers(2)) and
                                      not isinstance(mixer, ovq.LinearAttention))
                    elif call == 1:
                        mixer.step(state, q, k, v)
                    else:
                        mixer.absorb(state, k, v)
                except (TypeError, ValueError):
                    pass
            assert state.t >= 0
