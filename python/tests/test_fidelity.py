"""OVQ as the one public OVQ implementation reads the paper (docs/math.md, "Two readings of the
paper"): saturating growth and lowest-similarity seeding after assignment, unit-norm key and
value rows, the read without the log-count bias and the delta-rule value update, against a
NumPy reference of that reading written from its description, over random shapes, trailing
partial chunks and the empty dictionary; streaming equals chunked, the presets are their
options."""

import pickle

import numpy as np
import pytest

import ovq
from conftest import rel_err, unit_rows


def saturating(n_cap, t):
    return min(n_cap * t // (n_cap + t), n_cap)


def dictionary_read(query, dict_k, dict_v, counts, beta, count_bias):
    """softmax over the rows of beta query . D_k[r] (+ log c_r) of D_v: logits and values."""
    return beta * dict_k @ query + (np.log(counts) if count_bias else 0.0), dict_v


def softmax_read(logits, values):
    if len(logits) == 0:
        return np.zeros(values.shape[1])
    w = np.exp(logits - logits.max())
    return w @ values / w.sum()


def reference(q, k, v, n_cap, chunk, beta, renormalize=False, renormalize_values=False,
              count_bias=True, delta=False):
    """The outputs (T, dv) and the final dictionary (D_k, D_v, counts), in float64."""
    t_all, dk = k.shape
    dv = v.shape[1]
    dict_k, dict_v, counts = np.zeros((0, dk)), np.zeros((0, dv)), np.zeros(0)
    out = np.zeros((t_all, dv))
    for s in range(0, t_all, chunk):
        e = min(s + chunk, t_all)
        # Read: the dictionary as it was before the chunk (bias log c), then the chunk causally.
        for i in range(s, e):
            logits, values = dictionary_read(q[i], dict_k, dict_v, counts, beta, count_bias)
            out[i] = softmax_read(np.concatenate([logits, beta * k[s:i + 1] @ q[i]]),
                                  np.concatenate([values, v[s:i + 1]]))
        if e - s < chunk:
            break  # a trailing partial chunk is read, not written (it stays pending)
        kk, vv, n = k[s:e], v[s:e], len(counts)
        # The delta rule's predictions: the read of the dictionary before the chunk by each key.
        yhat = np.array([softmax_read(*dictionary_read(kk[i], dict_k, dict_v, counts, beta,
                                                       count_bias)) for i in range(chunk)])
        # S(t_e) - S(t_s) rows in that implementation; S(t_e) - n here, the same whenever the
        # dictionary has the S(t_s) rows the schedule gave it (docs/math.md, the documented
        # choice after an empty dictionary forced a row).
        m = max(saturating(n_cap, e) - n, 0)
        if n == 0:
            # Key 0 opens row 0; the m - 1 keys least similar to it open rows 1 ... m - 1; the
            # others join row 0. (A schedule opening nothing into an empty dictionary opens one.)
            m = max(m, 1)
            similarity = kk @ kk[0]
            others = sorted(range(1, chunk), key=lambda i: (similarity[i], i))[:m - 1]
            assign = np.zeros(chunk, dtype=int)
            for r, i in enumerate([0] + others):
                assign[i] = r
        else:
            scores = kk @ dict_k.T
            best, assign = scores.max(axis=1), scores.argmax(axis=1)
            m = min(m, n_cap - n)
            for j, i in enumerate(sorted(range(chunk), key=lambda i: (best[i], i))[:m]):
                assign[i] = n + j
        dict_k = np.concatenate([dict_k, np.zeros((m, dk))])
        dict_v = np.concatenate([dict_v, np.zeros((m, dv))])
        counts = np.concatenate([counts, np.zeros(m)])
        for r in np.unique(assign):
            members = assign == r
            cnt = members.sum()
            dict_k[r] = (counts[r] * dict_k[r] + kk[members].sum(axis=0)) / (counts[r] + cnt)
            if delta and r < n:
                dict_v[r] += (vv[members] - yhat[members]).sum(axis=0) / (counts[r] + cnt)
            else:  # the running mean (a new row: its seed alone)
                dict_v[r] = (counts[r] * dict_v[r] + vv[members].sum(axis=0)) / (counts[r] + cnt)
            counts[r] += cnt
            if renormalize:
                dict_k[r] /= np.linalg.norm(dict_k[r])
            if renormalize_values:
                dict_v[r] /= np.linalg.norm(dict_v[r])
    return out, (dict_k, dict_v, counts)


def mixer(n_cap, chunk, beta, renormalize=False, renormalize_values=False, count_bias=True,
          delta=False):
    return ovq.OVQAttention(capacity=n_cap, chunk=chunk, beta=beta,
                            growth=ovq.Growth.saturating(),
                            seeding=ovq.Seeding.lowest_similarity(), renormalize=renormalize,
                            renormalize_values=renormalize_values, count_bias=count_bias,
                            value_update="delta" if delta else "mean")


# The options of that reading beyond growth and seeding: (renormalize, renormalize_values,
# count_bias, delta); "kvm" and "kvm-delta" are the presets, each also without the count bias.
READINGS = {
    "plain": (False, False, True, False),
    "keys": (True, False, True, False),
    "kvm": (True, True, True, False),
    "kvm, no count bias": (True, True, False, False),
    "kvm-delta": (True, False, True, True),
    "kvm-delta, no count bias": (True, False, False, True),
    "delta, raw keys": (False, False, True, True),
}


@pytest.mark.parametrize("reading", READINGS)
@pytest.mark.parametrize("seed", range(6))
def test_matches_the_numpy_reference(seed, reading):
    renormalize, renormalize_values, count_bias, delta = READINGS[reading]
    rng = np.random.default_rng(seed)
    n_cap = int(rng.integers(1, 40))
    chunk = int(rng.integers(1, 24))
    t = int(rng.integers(1, 8 * chunk + 5))  # often a trailing partial chunk
    dk, dv = int(rng.integers(2, 12)), int(rng.integers(1, 9))
    beta = float(rng.uniform(0.5, 4.0))
    q = rng.standard_normal((t, dk))
    k = unit_rows(rng, t, dk)
    v = rng.standard_normal((t, dv))
    m = mixer(n_cap, chunk, beta, *READINGS[reading])
    state = m.make_state(dk, dv, dtype="float64")
    out = m.forward(state, q, k, v)
    ref_out, (ref_k, ref_v, ref_counts) = reference(q, k, v, n_cap, chunk, beta,
                                                    *READINGS[reading])
    assert rel_err(out, ref_out) < 1e-10
    assert np.array_equal(state.counts, ref_counts.astype(np.int64))
    assert np.allclose(state.keys, ref_k, rtol=0, atol=1e-12)
    assert np.allclose(state.values, ref_v, rtol=0, atol=1e-12)


def test_empty_dictionary_and_a_schedule_that_opens_nothing():
    # N = 1, L = 1: floor(1 * 1 / 2) = 0 rows after the first chunk; row 0 opens anyway.
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((5, 4)), unit_rows(rng, 5, 4), rng.standard_normal((5, 2))
    m = mixer(1, 1, 1.0)
    state = m.make_state(4, 2, dtype="float64")
    out = m.forward(state, q, k, v)
    ref_out, (_, _, counts) = reference(q, k, v, 1, 1, 1.0)
    assert rel_err(out, ref_out) < 1e-12 and list(state.counts) == list(counts) == [5]
    # The first chunk of a larger dictionary: key 0 and the keys least similar to it.
    q, k, v = rng.standard_normal((16, 4)), unit_rows(rng, 16, 4), rng.standard_normal((16, 2))
    m = mixer(64, 16, 1.0)
    state = m.make_state(4, 2, dtype="float64")
    m.absorb(state, k, v)
    opened = saturating(64, 16)
    assert state.n == opened
    assert np.allclose(state.keys[0], np.mean(
        k[[i for i in range(16) if i == 0 or i not in
           sorted(range(1, 16), key=lambda i: (k[i] @ k[0], i))[:opened - 1]]], axis=0))


def test_the_presets_are_their_options():
    assert ovq.OVQAttention.presets == ("default", "kvm", "kvm-delta")
    kvm = ovq.OVQAttention.preset("kvm", capacity=32)
    assert kvm.options == mixer(32, 64, 1.0, *READINGS["kvm"]).options
    assert ovq.OVQAttention.preset("kvm-delta").options["value_update"] == "delta"
    assert ovq.OVQAttention.preset("default").options == ovq.OVQAttention().options
    with pytest.raises(ValueError, match="name = 'KVM', expected default, kvm or kvm-delta"):
        ovq.OVQAttention.preset("KVM")
    with pytest.raises(ValueError, match="renormalize_values = true with value_update = delta"):
        ovq.OVQAttention.preset("kvm-delta", renormalize_values=True)
    with pytest.raises(ValueError, match="value_update = 'median', expected 'mean' or 'delta'"):
        ovq.OVQAttention(value_update="median")


def test_per_head_betas_read_each_head_with_its_own():
    rng = np.random.default_rng(5)
    b, hq, hkv, t, dk, dv = 2, 4, 2, 40, 8, 4
    q = rng.standard_normal((b, hq, t, dk))
    k = rng.standard_normal((b, hkv, t, dk))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((b, hkv, t, dv))
    betas = (0.5, 0.5, 3.0, 3.0)  # shared within each key/value head: the delta rule's write
    m = ovq.OVQAttention.preset("kvm-delta", capacity=16, chunk=8)
    layer = ovq.MultiHead(m, b, hq, hkv, dk, dv, dtype="float64", betas=betas)
    assert layer.betas == betas
    out = layer.forward(q, k, v)
    for bb in range(b):
        for h in range(hq):
            alone = ovq.OVQAttention.preset("kvm-delta", capacity=16, chunk=8, beta=betas[h])
            want = alone.forward(alone.make_state(dk, dv, dtype="float64"), q[bb, h],
                                 k[bb, h // 2], v[bb, h // 2])
            assert rel_err(out[bb, h], want) < 1e-12
    with pytest.raises(ValueError, match=r"betas\[1\] = 2, expected 0.5"):
        ovq.MultiHead(m, b, hq, hkv, dk, dv, betas=(0.5, 2.0, 3.0, 3.0))
    with pytest.raises(ValueError, match="betas has 2 entries, expected 4"):
        ovq.MultiHead(m, b, hq, hkv, dk, dv, betas=(1.0, 2.0))
    # The betas are part of a layer's saved state.
    again = ovq.MultiHead(m, b, hq, hkv, dk, dv, dtype="float64", betas=betas)
    again.load_bytes(layer.to_bytes())
    plain = ovq.MultiHead(m, b, hq, hkv, dk, dv, dtype="float64")
    with pytest.raises(ValueError, match="head betas: 4, expected 0"):
        plain.load_bytes(layer.to_bytes())
    copied = pickle.loads(pickle.dumps(layer))
    assert copied.betas == betas and copied.to_bytes() == layer.to_bytes()
    # The torch module takes them too.
    torch = pytest.importorskip("torch")
    import ovq.torch as ot
    module = ot.OVQAttention(b, hq, hkv, dk, dv, dtype=torch.float64, betas=betas,
                             **ovq.OVQAttention.preset("kvm-delta", capacity=16, chunk=8).options)
    got = module(*(torch.from_numpy(x) for x in (q, k, v)))
    assert rel_err(got.numpy(), out) < 1e-12


@pytest.mark.parametrize("reading", ["plain", "kvm", "kvm-delta, no count bias"])
def test_streaming_equals_chunked(reading):
    rng = np.random.default_rng(11)
    q, k, v = rng.standard_normal((150, 8)), unit_rows(rng, 150, 8), rng.standard_normal((150, 4))
    m = mixer(24, 16, 2.0, *READINGS[reading])
    whole = m.make_state(8, 4)
    o_whole = m.forward(whole, *(x.astype(np.float32) for x in (q, k, v)))
    steps = m.make_state(8, 4)
    o_steps = np.stack([m.step(steps, *(x[i].astype(np.float32) for x in (q, k, v)))
                        for i in range(150)])
    assert np.array_equal(o_steps, o_whole) and steps == whole
