"""OVQ as the one public OVQ implementation reads the paper (docs/math.md, "Two readings of the
paper"): saturating growth and lowest-similarity seeding after assignment, against a NumPy
reference of that reading written from its description, over random shapes, trailing partial
chunks and the empty dictionary; streaming equals chunked."""

import numpy as np
import pytest

import ovq
from conftest import rel_err, unit_rows


def saturating(n_cap, t):
    return min(n_cap * t // (n_cap + t), n_cap)


def reference(q, k, v, n_cap, chunk, beta, renormalize=False):
    """The outputs (T, dv) and the final dictionary (D_k, D_v, counts), in float64."""
    t_all, dk = k.shape
    dv = v.shape[1]
    dict_k, dict_v, counts = np.zeros((0, dk)), np.zeros((0, dv)), np.zeros(0)
    out = np.zeros((t_all, dv))
    for s in range(0, t_all, chunk):
        e = min(s + chunk, t_all)
        # Read: the dictionary as it was before the chunk (bias log c), then the chunk causally.
        for i in range(s, e):
            logits = np.concatenate([beta * dict_k @ q[i] + np.log(counts),
                                     beta * k[s:i + 1] @ q[i]])
            w = np.exp(logits - logits.max())
            out[i] = w @ np.concatenate([dict_v, v[s:i + 1]]) / w.sum()
        if e - s < chunk:
            break  # a trailing partial chunk is read, not written (it stays pending)
        kk, vv, n = k[s:e], v[s:e], len(counts)
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
            dict_v[r] = (counts[r] * dict_v[r] + vv[members].sum(axis=0)) / (counts[r] + cnt)
            counts[r] += cnt
            if renormalize:
                dict_k[r] /= np.linalg.norm(dict_k[r])
    return out, (dict_k, dict_v, counts)


def mixer(n_cap, chunk, beta, renormalize=False):
    return ovq.OVQAttention(capacity=n_cap, chunk=chunk, beta=beta,
                            growth=ovq.Growth.saturating(),
                            seeding=ovq.Seeding.lowest_similarity(), renormalize=renormalize)


@pytest.mark.parametrize("seed", range(8))
def test_matches_the_numpy_reference(seed):
    rng = np.random.default_rng(seed)
    n_cap = int(rng.integers(1, 40))
    chunk = int(rng.integers(1, 24))
    t = int(rng.integers(1, 8 * chunk + 5))  # often a trailing partial chunk
    dk, dv = int(rng.integers(2, 12)), int(rng.integers(1, 9))
    beta = float(rng.uniform(0.5, 4.0))
    renormalize = bool(seed % 2)
    q = rng.standard_normal((t, dk))
    k = unit_rows(rng, t, dk)
    v = rng.standard_normal((t, dv))
    m = mixer(n_cap, chunk, beta, renormalize)
    state = m.make_state(dk, dv, dtype="float64")
    out = m.forward(state, q, k, v)
    ref_out, (ref_k, ref_v, ref_counts) = reference(q, k, v, n_cap, chunk, beta, renormalize)
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


def test_streaming_equals_chunked():
    rng = np.random.default_rng(11)
    q, k, v = rng.standard_normal((150, 8)), unit_rows(rng, 150, 8), rng.standard_normal((150, 4))
    m = mixer(24, 16, 2.0)
    whole = m.make_state(8, 4)
    o_whole = m.forward(whole, *(x.astype(np.float32) for x in (q, k, v)))
    steps = m.make_state(8, 4)
    o_steps = np.stack([m.step(steps, *(x[i].astype(np.float32) for x in (q, k, v)))
                        for i in range(150)])
    assert np.array_equal(o_steps, o_whole) and steps == whole
