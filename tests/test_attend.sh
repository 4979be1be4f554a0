#!/usr/bin/env bash
# End-to-end test of the `attend` command-line tool (examples/attend.cpp).
#
#   bash tests/test_attend.sh path/to/attend
#
# Random inputs are generated with NumPy, attend is run on them, and its outputs are compared with
# an independent NumPy implementation of the formulas of MATH.md (float64 references; relative
# tolerance 1e-4 for float32 runs, 1e-10 for float64 runs). Also checked: grouped-query heads with
# dk != dv, --stream / --split against one forward call, the --state-out files, and that bad
# input fails cleanly (exit status 1 or 2, one "attend: " line on stderr, no output file).
#
# Exit status: 0 pass, 1 fail, 77 skipped (no NumPy for /usr/bin/python3; CTest SKIP_RETURN_CODE).
set -u

ATTEND=${1:-}
PYTHON=/usr/bin/python3

if [ -z "$ATTEND" ]; then
  echo "usage: $0 PATH/TO/attend" >&2
  exit 1
fi
if [ ! -x "$ATTEND" ]; then
  echo "FAIL: '$ATTEND' is not an executable file" >&2
  exit 1
fi
if [ ! -x "$PYTHON" ] || ! "$PYTHON" -c 'import numpy' >/dev/null 2>&1; then
  echo "SKIP: python3-numpy missing"
  exit 77
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/test_attend.XXXXXX") || exit 1
trap 'rm -rf "$WORK"' EXIT

"$PYTHON" - "$ATTEND" "$WORK" <<'PYEOF'
import json
import os
import subprocess
import sys

import numpy as np

ATTEND, WORK = sys.argv[1], sys.argv[2]
TOL = {np.float32: 1e-4, np.float64: 1e-10, np.float16: 4e-3, "bf16": 2.5e-2}
passed = 0
failed = []
counter = [0]


def ok(cond, what):
    global passed
    if cond:
        passed += 1
    else:
        failed.append(what)
        print("FAIL:", what)
    return cond


def path(name):
    return os.path.join(WORK, name)


def fresh(stem):
    counter[0] += 1
    return path("%s_%d" % (stem, counter[0]))


def save(arr, stem="in"):
    p = fresh(stem) + ".npy"
    np.save(p, arr)
    return p


def run(args):
    return subprocess.run([ATTEND] + [str(a) for a in args], capture_output=True, text=True,
                          timeout=300)


def attend(mixer, Q, K, V, *extra, what):
    """Runs attend on arrays; returns O (or None after recording a failure)."""
    out = fresh("out") + ".npy"
    r = run([mixer, "--q", save(Q), "--k", save(K), "--v", save(V), "--out", out] + list(extra))
    if not ok(r.returncode == 0, "%s: exit %d, stderr %r" % (what, r.returncode, r.stderr)):
        return None
    ok(r.stderr == "", "%s: unexpected stderr %r" % (what, r.stderr))
    O = np.load(out)
    want_shape = Q.shape[:-1] + (V.shape[-1],)
    ok(O.shape == want_shape, "%s: O shape %s, expected %s" % (what, O.shape, want_shape))
    want_dtype = np.float32 if "bf16" in [str(e) for e in extra] else Q.dtype
    ok(O.dtype == want_dtype, "%s: O dtype %s, expected %s" % (what, O.dtype, want_dtype))
    return O


def rel_err(got, ref):
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    if got.shape != ref.shape:
        return np.inf
    if ref.size == 0:
        return 0.0
    scale = max(np.max(np.abs(ref)), 1e-300)
    return float(np.max(np.abs(got - ref)) / scale)


def close(got, ref, dtype, what):
    if got is None:
        return False
    e = rel_err(got, ref)
    return ok(e <= TOL[dtype], "%s: relative error %.3g > %.1g" % (what, e, TOL[dtype]))


# ---- references (float64, one head at a time) --------------------------------------------------

def softmax_rows(logits, mask, values):
    l = np.where(mask, logits, -np.inf)
    m = np.max(l, axis=1, keepdims=True)
    w = np.where(mask, np.exp(l - m), 0.0)
    return (w @ values) / np.sum(w, axis=1, keepdims=True)


def ref_self(q, k, v, beta, window=0, causal=True):
    T = q.shape[0]
    i = np.arange(T)[:, None]
    j = np.arange(T)[None, :]
    mask = (j <= i) if causal else np.ones((T, T), bool)
    if window:
        mask &= j > i - window
    return softmax_rows(beta * (q @ k.T), mask, v)


def phi(x, fm):
    if fm == "identity":
        return x
    if fm == "elu1":
        return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))
    if fm == "relu":
        return np.maximum(x, 0.0)
    raise ValueError(fm)


def ref_linear(q, k, v, beta, fm="identity", normalize=False, decay=1.0, eps=1e-6):
    S = np.zeros((k.shape[1], v.shape[1]))
    z = np.zeros(k.shape[1])
    out = np.zeros((q.shape[0], v.shape[1]))
    for i in range(q.shape[0]):
        pk, pq = phi(k[i], fm), phi(q[i], fm)
        S = decay * S + np.outer(pk, v[i])
        z = decay * z + pk
        out[i] = S.T @ pq / (z @ pq + eps) if normalize else beta * (S.T @ pq)
    return out


def quantise(k, C):
    d2 = ((k[:, None, :] - C[None, :, :]) ** 2).sum(-1)
    return np.argmin(d2, axis=1), d2


def ref_vq(q, k, v, beta, C):
    codes, _ = quantise(k, C)
    return ref_self(q, C[codes], v, beta)


def heads3(a):
    return a if a.ndim == 3 else a[None]


def per_head(Q, K, V, fn):
    """fn(q, k, v, kv_head) for every query head, grouped-query mapping; O shaped like Q."""
    Q3, K3, V3 = (heads3(np.asarray(a, np.float64)) for a in (Q, K, V))
    g = Q3.shape[0] // K3.shape[0]
    O = np.stack([fn(Q3[h], K3[h // g], V3[h // g], h // g) for h in range(Q3.shape[0])])
    return O if np.asarray(Q).ndim == 3 else O[0]


# ---- inputs ------------------------------------------------------------------------------------

rng = np.random.default_rng(20260401)


def randn(shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


def unit_rows(a):
    return (a / np.linalg.norm(a, axis=-1, keepdims=True)).astype(a.dtype)


def layouts(dtype):
    """(name, Q, K, V): grouped queries with dk != dv, and one 2-d head."""
    T = 37
    gqa = (randn((4, T, 8), dtype), randn((2, T, 8), dtype), randn((2, T, 5), dtype))
    one = (randn((23, 6), dtype), randn((23, 6), dtype), randn((23, 4), dtype))
    return [("gqa Hq=4 Hkv=2 dk=8 dv=5", *gqa), ("1 head dk=6 dv=4", *one)]


def vq_codebook(K, S, dtype, per_head_books, rounding=None):
    """A codebook whose nearest codes are unambiguous for every key (margin well above rounding);
    rounding (optional) maps the drawn codebook to the one used, before its margin is measured."""
    K3 = heads3(np.asarray(K, np.float64))
    for _ in range(100):
        shape = (K3.shape[0], S, K3.shape[2]) if per_head_books else (S, K3.shape[2])
        C = randn(shape, dtype)
        if rounding is not None:
            C = rounding(C)
        C3 = C if C.ndim == 3 else np.broadcast_to(C, (K3.shape[0],) + C.shape)
        margin = np.inf
        for h in range(K3.shape[0]):
            _, d2 = quantise(K3[h], np.asarray(C3[h], np.float64))
            s = np.sort(d2, axis=1)
            margin = min(margin, float(np.min(s[:, 1] - s[:, 0])))
        if margin > 1e-2:
            return C
    raise RuntimeError("could not draw a codebook with clear nearest codes")


# ---- 1. outputs against the references ---------------------------------------------------------

for dtype in (np.float32, np.float64):
    dn = np.dtype(dtype).name
    for lname, Q, K, V in layouts(dtype):
        tag = "%s %s" % (dn, lname)
        T = Q.shape[-2]

        beta = 0.5
        for extra, kw in (([], {}), (["--window", "5"], {"window": 5}),
                          (["--noncausal"], {"causal": False})):
            what = "self %s %s" % (" ".join(extra) or "causal", tag)
            O = attend("self", Q, K, V, "--beta", beta, "--chunk", 8, *extra, what=what)
            close(O, per_head(Q, K, V, lambda q, k, v, g: ref_self(q, k, v, beta, **kw)), dtype, what)

        for fm, norm, decay in (("identity", False, 1.0), ("elu1", False, 1.0), ("relu", False, 1.0),
                                ("elu1", True, 1.0), ("relu", True, 0.9), ("identity", False, 0.8),
                                ("elu1", True, 0.7)):
            extra = ["--feature-map", fm, "--decay", decay] + (["--normalize"] if norm else [])
            what = "linear %s %s" % (" ".join(map(str, extra)), tag)
            O = attend("linear", Q, K, V, "--beta", 0.3, "--chunk", 6, *extra, what=what)
            close(O, per_head(Q, K, V, lambda q, k, v, g: ref_linear(q, k, v, 0.3, fm, norm, decay)),
                  dtype, what)

        for books in (True, False):
            C = vq_codebook(K, 7, dtype, books and Q.ndim == 3)
            C3 = heads3(np.asarray(C, np.float64)) if C.ndim == 3 else None
            what = "vq codebook %s %s" % (C.shape, tag)
            O = attend("vq", Q, K, V, "--codebook", save(C), "--beta", 0.7, "--chunk", 6, what=what)
            ref = per_head(Q, K, V, lambda q, k, v, g: ref_vq(
                q, k, v, 0.7, C3[g] if C3 is not None else np.asarray(C, np.float64)))
            close(O, ref, dtype, what)

        # OVQ with one centroid per token and room for all of them is causal self-attention
        # (distinct unit-norm keys: each key is its own nearest centroid, count 1).
        Ku = unit_rows(K)
        for cap in (T, T + 5):
            what = "ovq linear growth capacity %d %s" % (cap, tag)
            O = attend("ovq", Q, Ku, V, "--growth", "linear", "--rate", 1, "--capacity", cap,
                       "--chunk", 8, "--beta", 2.0, what=what)
            close(O, per_head(Q, Ku, V, lambda q, k, v, g: ref_self(q, k, v, 2.0)), dtype, what)


# ---- 2. --stream and --split give the output of one forward call ------------------------------

def pieces(T):
    a, b = T // 3, T // 4
    return ",".join(map(str, [a, 0, b, 1, T - a - b - 1]))


configs = [
    ("self", ["--beta", 0.5, "--chunk", 4]),
    ("self", ["--window", 6, "--chunk", 4]),
    ("linear", ["--feature-map", "elu1", "--normalize", "--decay", 0.9, "--chunk", 5]),
    ("linear", ["--feature-map", "identity", "--chunk", 5]),
    ("vq", ["--chunk", 5]),
    ("ovq", ["--capacity", 12, "--chunk", 5]),
    ("ovq", ["--capacity", 9, "--chunk", 4, "--growth", "linear", "--rate", 0.5,
             "--seeding", "random", "--seed", 7, "--lr", "constant", "--eta", 0.3, "--renormalize"]),
    ("ovq", ["--capacity", 20, "--chunk", 6, "--growth", "dirichlet", "--alpha", 3]),
    ("ovq", ["--capacity", 10, "--chunk", 5, "--growth", "saturating",
             "--seeding", "lowest_similarity"]),
    ("ovq", ["--preset", "kvm", "--capacity", 10, "--chunk", 5]),
    ("ovq", ["--preset", "kvm-delta", "--capacity", 10, "--chunk", 5, "--no-count-bias"]),
    ("ovq", ["--capacity", 12, "--chunk", 4, "--value-update", "delta", "--lr", "constant",
             "--eta", 0.5]),
]
for dtype in (np.float32, np.float64):
    dn = np.dtype(dtype).name
    for lname, Q, K, V in layouts(dtype):
        T = Q.shape[-2]
        for mixer, opts in configs:
            opts = list(opts)
            if mixer == "vq":
                opts += ["--codebook", save(vq_codebook(K, 6, dtype, False))]
            what = "%s %s %s %s" % (mixer, " ".join(map(str, opts[:8])), dn, lname)
            plain = attend(mixer, Q, K, V, *opts, what="plain " + what)
            streamed = attend(mixer, Q, K, V, *opts, "--stream", "--threads", 2,
                              what="--stream " + what)
            split = attend(mixer, Q, K, V, *opts, "--split", pieces(T), what="--split " + what)
            if plain is not None:
                close(streamed, plain, dtype, "--stream vs plain: " + what)
                close(split, plain, dtype, "--split %s vs plain: %s" % (pieces(T), what))


# A preset is its options: --preset kvm and kvm-delta give the bits of their flags spelt out.
Q, K, V = layouts(np.float32)[0][1:]
spelt = ["--growth", "saturating", "--seeding", "lowest_similarity", "--renormalize"]
for preset, flags in (("kvm", spelt + ["--renormalize-values"]),
                      ("kvm-delta", spelt + ["--value-update", "delta"]),
                      ("default", [])):
    a = attend("ovq", Q, K, V, "--preset", preset, "--capacity", 10, "--chunk", 5,
               what="--preset " + preset)
    b = attend("ovq", Q, K, V, *flags, "--capacity", 10, "--chunk", 5, what="flags of " + preset)
    if a is not None and b is not None:
        ok(np.array_equal(a, b), "--preset %s differs from its flags" % preset)
# The flags after a preset override it.
a = attend("ovq", Q, K, V, "--preset", "kvm", "--growth", "dirichlet", "--capacity", 10,
           "--chunk", 5, what="--preset kvm --growth dirichlet")
b = attend("ovq", Q, K, V, "--seeding", "lowest_similarity", "--renormalize",
           "--renormalize-values", "--capacity", 10, "--chunk", 5, what="kvm with dirichlet")
if a is not None and b is not None:
    ok(np.array_equal(a, b), "--preset kvm --growth dirichlet differs from its flags")

# --head-betas: equal betas are --beta, bit for bit; distinct ones read each head with its own
# (query heads 0, 1 share key/value head 0; 2, 3 share head 1).
for mixer, opts in (("self", ["--chunk", 4]), ("ovq", ["--capacity", 12, "--chunk", 5]),
                    ("ovq", ["--preset", "kvm-delta", "--capacity", 12, "--chunk", 5])):
    same = attend(mixer, Q, K, V, *opts, "--head-betas", "0.7,0.7,0.7,0.7", what="equal head betas")
    one = attend(mixer, Q, K, V, *opts, "--beta", 0.7, what="--beta 0.7")
    if same is not None and one is not None:
        ok(np.array_equal(same, one),
           "%s %s: equal --head-betas differ from --beta" % (mixer, opts))
    betas = [0.5, 0.5, 2.0, 2.0] if "kvm-delta" in opts else [0.5, 1.0, 2.0, 3.0]
    mixed = attend(mixer, Q, K, V, *opts, "--head-betas", ",".join(map(str, betas)),
                   what="--head-betas %s" % betas)
    for h, beta in enumerate(betas):
        alone = attend(mixer, Q[h], K[h // 2], V[h // 2], *opts, "--beta", beta,
                       what="head %d alone" % h)
        if mixed is not None and alone is not None:
            close(mixed[h], alone, np.float32,
                  "%s %s: head %d with beta %g" % (mixer, opts, h, beta))


# ---- 3. --state-out --------------------------------------------------------------------------

def state_files(prefix, hkv):
    info = json.load(open(prefix + ".json"))
    bases = [prefix] if hkv == 1 else ["%s.h%d" % (prefix, h) for h in range(hkv)]
    heads = []
    for h, base in enumerate(bases):
        def field(name):
            return info[name] if hkv == 1 else info[name][h]
        heads.append(dict(n=field("n"), t=field("t"), pending=field("pending"),
                          dk=np.load(base + ".dk.npy"), dv=np.load(base + ".dv.npy"),
                          counts=np.load(base + ".counts.npy")))
    return info, heads


def check_state(prefix, hkv, dtype, T, what, capacity=None, chunk=None):
    names = [prefix + ".json"]
    bases = [prefix] if hkv == 1 else ["%s.h%d" % (prefix, h) for h in range(hkv)]
    names += [b + s for b in bases for s in (".dk.npy", ".dv.npy", ".counts.npy")]
    missing = [n for n in names if not os.path.isfile(n)]
    if not ok(not missing, "%s: missing state files %s" % (what, missing)):
        return None
    info, heads = state_files(prefix, hkv)
    ok(info.get("kv_heads") == hkv, "%s: kv_heads %r, expected %d" % (what, info.get("kv_heads"), hkv))
    for h, s in enumerate(heads):
        w = "%s head %d" % (what, h)
        n, t, pend = s["n"], s["t"], s["pending"]
        ok(all(isinstance(x, int) for x in (n, t, pend)), w + ": n, t, pending must be integers")
        ok(s["dk"].shape[0] == n and s["dv"].shape[0] == n and s["counts"].shape == (n,),
           "%s: shapes %s %s %s for n = %d" % (w, s["dk"].shape, s["dv"].shape, s["counts"].shape, n))
        ok(s["dk"].dtype == dtype and s["dv"].dtype == dtype, w + ": dk/dv dtype")
        ok(s["counts"].dtype == np.float64, w + ": counts must be float64")
        c = s["counts"]
        ok(np.all(c >= 0) and np.all(c == np.round(c)), w + ": counts must be non-negative integers")
        ok(int(c.sum()) == t, "%s: counts sum to %d, t = %d" % (w, int(c.sum()), t))
        ok(t + pend == T, "%s: t + pending = %d, expected T = %d" % (w, t + pend, T))
        if capacity is not None:
            ok(1 <= n <= capacity or T < chunk, "%s: n = %d outside [1, %d]" % (w, n, capacity))
        if chunk is not None:
            ok(t % chunk == 0 and 0 <= pend < chunk,
               "%s: t = %d, pending = %d with chunk %d" % (w, t, pend, chunk))
    return heads


for dtype in (np.float32, np.float64):
    dn = np.dtype(dtype).name
    for lname, Q, K, V in layouts(dtype):
        T = Q.shape[-2]
        hkv = heads3(K).shape[0]
        K3, V3 = heads3(np.asarray(K, np.float64)), heads3(np.asarray(V, np.float64))

        # vq: the codebook rows, a count per code and the mean value of each code, over the
        # complete chunks of 5 tokens; the last, incomplete chunk is pending.
        C = vq_codebook(K, 6, dtype, K.ndim == 3)
        prefix = fresh("vqstate")
        what = "vq --state-out %s %s" % (dn, lname)
        attend("vq", Q, K, V, "--codebook", save(C), "--chunk", 5, "--state-out", prefix, what=what)
        heads = check_state(prefix, hkv, dtype, T, what, chunk=5)
        absorbed = T - T % 5
        for h, s in enumerate(heads or []):
            Ch = np.asarray(C[h] if C.ndim == 3 else C, np.float64)
            codes, _ = quantise(K3[h][:absorbed], Ch)
            cnt = np.bincount(codes, minlength=Ch.shape[0])
            ok(s["n"] == Ch.shape[0] and s["pending"] == T % 5,
               what + ": n must be S, pending T mod 5")
            ok(np.array_equal(s["counts"], cnt), "%s head %d: counts %s, expected %s"
               % (what, h, s["counts"], cnt))
            ok(np.array_equal(s["dk"], np.asarray(C[h] if C.ndim == 3 else C)),
               what + ": dk must be the codebook")
            means = np.zeros((Ch.shape[0], V3.shape[2]))
            for code in range(Ch.shape[0]):
                if cnt[code]:
                    means[code] = V3[h][:absorbed][codes == code].mean(axis=0)
            e = rel_err(s["dv"], means)
            ok(e <= TOL[dtype], "%s head %d: mean values off by %.3g" % (what, h, e))

        # ovq, one centroid per token: the dictionary is the absorbed keys and values, counts 1.
        Ku = unit_rows(K)
        prefix = fresh("ovqstate")
        what = "ovq linear --state-out %s %s" % (dn, lname)
        attend("ovq", Q, Ku, V, "--growth", "linear", "--capacity", T, "--chunk", 8,
               "--state-out", prefix, what=what)
        heads = check_state(prefix, hkv, dtype, T, what, capacity=T, chunk=8)
        Ku3 = heads3(Ku)
        for h, s in enumerate(heads or []):
            t = s["t"]
            ok(t == T - T % 8 and s["n"] == t, "%s: t = %d, n = %d" % (what, t, s["n"]))
            ok(np.all(s["counts"] == 1), what + ": every count must be 1")
            # Seeding opens a chunk's centroids in spread order, so the rows are the absorbed
            # tokens in some order: match each row to its key.
            which = np.argmax(np.asarray(s["dk"], np.float64) @ np.asarray(Ku3[h][:t], np.float64).T,
                              axis=1)
            if ok(np.array_equal(np.sort(which), np.arange(t)),
                  what + ": dk rows must be the absorbed keys, each once"):
                ok(rel_err(s["dk"], Ku3[h][which]) <= TOL[dtype], what + ": dk must be the absorbed keys")
                ok(rel_err(s["dv"], V3[h][which]) <= TOL[dtype],
                   what + ": dv must be the values of those keys")

        # ovq, default growth; the state after --stream / --split equals the one-call state.
        for opts in (["--capacity", 10, "--chunk", 6],
                     ["--capacity", 7, "--chunk", 5, "--renormalize", "--lr", "constant",
                      "--eta", 0.5, "--seeding", "random", "--seed", 3]):
            states = []
            for mode in ([], ["--stream"], ["--split", pieces(T)]):
                prefix = fresh("ovqstate")
                what = "ovq %s %s --state-out %s %s" % (" ".join(map(str, opts)), " ".join(mode),
                                                        dn, lname)
                attend("ovq", Q, K, V, *opts, *mode, "--state-out", prefix, what=what)
                heads = check_state(prefix, hkv, dtype, T, what, capacity=opts[1], chunk=opts[3])
                states.append(heads)
                if heads and "--renormalize" in opts:
                    for s in heads:
                        used = s["counts"] > 0
                        norms = np.linalg.norm(np.asarray(s["dk"][used], np.float64), axis=1)
                        ok(np.all(np.abs(norms - 1) <= 10 * TOL[dtype]),
                           what + ": renormalised key rows must have unit norm")
            if all(states):
                for mode, other in zip(("--stream", "--split"), states[1:]):
                    for h, (a, b) in enumerate(zip(states[0], other)):
                        w = "ovq state %s vs plain %s %s head %d" % (mode, dn, lname, h)
                        if ok((a["n"], a["t"], a["pending"]) == (b["n"], b["t"], b["pending"])
                              and np.array_equal(a["counts"], b["counts"]), w + ": n/t/counts"):
                            ok(rel_err(b["dk"], a["dk"]) <= TOL[dtype]
                               and rel_err(b["dv"], a["dv"]) <= TOL[dtype], w + ": rows")


# ---- 4. bad input fails cleanly ----------------------------------------------------------------

Q = randn((4, 10, 8), np.float32)
K = randn((2, 10, 8), np.float32)
V = randn((2, 10, 3), np.float32)
q, k, v = save(Q, "q"), save(K, "k"), save(V, "v")
nan_k = K.copy()
nan_k[1, 3, 2] = np.nan
truncated = fresh("trunc") + ".npy"
with open(k, "rb") as f:
    data = f.read()
with open(truncated, "wb") as f:
    f.write(data[:-7])
garbage = fresh("garbage") + ".npy"
with open(garbage, "wb") as f:
    f.write(b"this is not an npy file\n")
codebook = save(randn((5, 8), np.float32), "cb")
base = ["--q", q, "--k", k, "--v", v]

bad = [
    # (what, arguments without --out, expected exit status)
    ("missing Q file", ["self", "--q", path("does_not_exist.npy"), "--k", k, "--v", v], 1),
    ("int32 K", ["self", "--q", q, "--k", save(K.astype(np.int32)), "--v", v], 1),
    ("float16 V", ["self", "--q", q, "--k", k, "--v", save(V.astype(np.float16))], 1),
    ("big-endian K", ["self", "--q", q, "--k", save(K.astype(">f4")), "--v", v], 1),
    ("fortran-order V", ["self", "--q", q, "--k", k, "--v", save(np.asfortranarray(V[0]))], 1),
    ("truncated K", ["self", "--q", q, "--k", truncated, "--v", v], 1),
    ("not an npy file", ["self", "--q", garbage, "--k", k, "--v", v], 1),
    ("mixed dtypes", ["self", "--q", save(Q.astype(np.float64)), "--k", k, "--v", v], 1),
    ("K with other T", ["self", "--q", q, "--k", save(K[:, :9]), "--v", v], 1),
    ("K with other dk", ["self", "--q", q, "--k", save(K[:, :, :7]), "--v", v], 1),
    ("V heads != K heads", ["self", "--q", q, "--k", k, "--v", save(V[:1])], 1),
    ("Hq not a multiple of Hkv", ["self", "--q", save(Q[:3]), "--k", k, "--v", v], 1),
    ("1-d Q", ["self", "--q", save(Q.reshape(-1)), "--k", k, "--v", v], 1),
    ("4-d Q", ["self", "--q", save(Q[None]), "--k", k, "--v", v], 1),
    ("NaN in K", ["linear", "--q", q, "--k", save(nan_k), "--v", v], 1),
    ("codebook with other dk", ["vq", *base, "--codebook", save(randn((5, 6), np.float32))], 1),
    ("codebook heads != Hkv", ["vq", *base, "--codebook", save(randn((3, 5, 8), np.float32))], 1),
    ("float64 codebook", ["vq", *base, "--codebook", save(randn((5, 8), np.float64))], 1),
    ("missing codebook file", ["vq", *base, "--codebook", path("nope.npy")], 1),
    ("--chunk 0", ["self", *base, "--chunk", "0"], 1),
    ("--capacity -3", ["ovq", *base, "--capacity", "-3"], 1),
    ("--decay 1.5", ["linear", *base, "--decay", "1.5"], 1),
    ("--beta nan", ["self", *base, "--beta", "nan"], 1),
    ("--window -1", ["self", *base, "--window", "-1"], 1),
    ("--eta 0", ["ovq", *base, "--lr", "constant", "--eta", "0"], 1),
    ("--split too short", ["self", *base, "--split", "3,4"], 1),
    ("--split too long", ["ovq", *base, "--split", "5,6"], 1),
    ("unknown mixer", ["softmax", *base], 2),
    ("no mixer", [*base], 2),
    ("two mixers", ["self", "linear", *base], 2),
    ("unknown option", ["self", *base, "--temperature", "2"], 2),
    ("missing value", ["self", *base, "--beta"], 2),
    ("non-numeric value", ["self", *base, "--beta", "fast"], 2),
    ("trailing garbage in number", ["self", *base, "--chunk", "16x"], 2),
    ("float for an integer", ["ovq", *base, "--capacity", "1.5"], 2),
    ("empty number", ["self", *base, "--beta="], 2),
    ("value for a flag", ["self", *base, "--noncausal=yes"], 2),
    ("option given twice", ["self", *base, "--beta", "1", "--beta", "2"], 2),
    ("--window with ovq", ["ovq", *base, "--window", "4"], 2),
    ("--capacity with self", ["self", *base, "--capacity", "4"], 2),
    ("--normalize with vq", ["vq", *base, "--codebook", codebook, "--normalize"], 2),
    ("--codebook with linear", ["linear", *base, "--codebook", codebook], 2),
    ("--state-out with self", ["self", *base, "--state-out", path("st")], 2),
    ("vq without --codebook", ["vq", *base], 2),
    ("missing --k", ["self", "--q", q, "--v", v], 2),
    ("bad feature map", ["linear", *base, "--feature-map", "tanh"], 2),
    ("bad growth", ["ovq", *base, "--growth", "exponential"], 2),
    ("--rate with dirichlet growth", ["ovq", *base, "--rate", "0.5"], 2),
    ("--seed with spread seeding", ["ovq", *base, "--seed", "4"], 2),
    ("negative --seed", ["ovq", *base, "--seeding", "random", "--seed", "-4"], 2),
    ("--lr constant without --eta", ["ovq", *base, "--lr", "constant"], 2),
    ("--stream with --split", ["self", *base, "--stream", "--split", "10"], 2),
    ("--noncausal with --stream", ["self", *base, "--noncausal", "--stream"], 2),
    ("bad --split list", ["self", *base, "--split", "3,,7"], 2),
    ("negative --split length", ["self", *base, "--split", "12,-2"], 2),
    ("negative --threads", ["self", *base, "--threads", "-1"], 2),
    ("bad --device", ["self", *base, "--device", "tpu"], 2),
    ("bad --preset", ["ovq", *base, "--preset", "kvm2"], 2),
    ("--preset with self", ["self", *base, "--preset", "kvm"], 2),
    ("bad --value-update", ["ovq", *base, "--value-update", "median"], 2),
    ("--head-betas with linear", ["linear", *base, "--head-betas", "1,1"], 2),
    ("bad --head-betas list", ["self", *base, "--head-betas", "1,,2"], 2),
    ("--head-betas of another length", ["self", *base, "--head-betas", "1,2,3"], 1),
    ("--head-betas -1", ["self", *base, "--head-betas", "1,1,-1,1"], 1),
    ("--head-betas unshared under delta",
     ["ovq", *base, "--preset", "kvm-delta", "--head-betas", "1,2,3,4"], 1),
    ("--renormalize-values with delta",
     ["ovq", *base, "--value-update", "delta", "--renormalize-values"], 1),
]
for what, args, want in bad:
    out = fresh("bad_out") + ".npy"
    # --out goes last, except where the test is about a last option without its value.
    full = list(args) + ["--out", out]
    if what == "missing value":
        full = list(args[:-1]) + ["--out", out, args[-1]]
    r = run(full)
    lines = r.stderr.splitlines()
    ok(r.returncode == want, "%s: exit %d, expected %d (stderr %r)" % (what, r.returncode, want, r.stderr))
    ok(0 < r.returncode < 128, "%s: exit %d is not a clean error" % (what, r.returncode))
    ok(len(lines) == 1 and lines[0].startswith("attend: ") and r.stderr.endswith("\n"),
       "%s: stderr must be one 'attend: ' line, got %r" % (what, r.stderr))
    ok(not os.path.exists(out), "%s: output file written despite the error" % what)

r = run(["ovq", *base, "--out", path("no_such_dir/o.npy")])
ok(r.returncode == 1 and len(r.stderr.splitlines()) == 1 and r.stderr.startswith("attend: "),
   "unwritable output: exit %d, stderr %r" % (r.returncode, r.stderr))
r = run([])
ok(r.returncode == 2 and len(r.stderr.splitlines()) == 1 and r.stderr.startswith("attend: "),
   "no arguments: exit %d, stderr %r" % (r.returncode, r.stderr))
r = run(["--help"])
ok(r.returncode == 0 and r.stdout.startswith("usage: attend") and "--state-out" in r.stdout
   and r.stderr == "", "--help: exit %d, stderr %r" % (r.returncode, r.stderr))

# ---- 16-bit runs: float16 inputs, and --storage bf16 ----------------------------------------
# The references run on the 16-bit values (widened to float64); the bounds are those of a
# 16-bit computation (its outputs are rounded to 16 bits, its dictionaries read rounded rows).
def to_bf16(a):
    """float32 -> the nearest bfloat16, as float32 (round to nearest, ties to even)."""
    b = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
    return b.astype(np.uint32).view(np.float32)

for kind in (np.float16, "bf16"):
    for lname, Q, K, V in layouts(np.float32):
        if kind == np.float16:
            Q, K, V = Q.astype(np.float16), K.astype(np.float16), V.astype(np.float16)
            extra, Qr, Kr, Vr = [], Q, K, V
        else:
            extra, Qr, Kr, Vr = ["--storage", "bf16"], to_bf16(Q), to_bf16(K), to_bf16(V)
        tag = "%s %s" % ("float16" if kind == np.float16 else "bf16", lname)
        what = "self %s" % tag
        O = attend("self", Q, K, V, "--beta", 0.5, "--chunk", 8, *extra, what=what)
        close(O, per_head(Qr, Kr, Vr, lambda q, k, v, g: ref_self(q, k, v, 0.5)), kind, what)
        what = "linear %s" % tag
        O = attend("linear", Q, K, V, "--beta", 0.3, "--chunk", 6, "--feature-map", "elu1",
                   "--normalize", *extra, what=what)
        close(O, per_head(Qr, Kr, Vr, lambda q, k, v, g: ref_linear(q, k, v, 0.3, "elu1", True)),
              kind, what)
        Ku = unit_rows(np.asarray(Kr, np.float32))
        Ku = Ku.astype(np.float16) if kind == np.float16 else to_bf16(Ku)
        what = "ovq %s" % tag
        O = attend("ovq", Q, Ku, V, "--growth", "linear", "--capacity", Q.shape[-2], "--chunk", 8,
                   "--beta", 2.0, *extra, what=what)
        close(O, per_head(Qr, Ku, Vr, lambda q, k, v, g: ref_self(q, k, v, 2.0)), kind, what)

# ---- --device cuda: the same computation on a GPU ---------------------------------------------
# Three cases, each checked: an attend built without CUDA refuses the option (exit 2); one built
# with CUDA on a machine without a GPU says so (exit 1); with a GPU every mixer's output is
# compared with the references, as on the CPU, whole and token by token.
probe_out = fresh("cuda_probe") + ".npy"
r = run(["self", *base, "--device", "cuda", "--out", probe_out])
lines = r.stderr.splitlines()
if r.returncode == 2:
    ok(len(lines) == 1 and "built without CUDA" in lines[0],
       "--device cuda in a CPU-only build: stderr %r" % r.stderr)
elif r.returncode == 1:
    ok(len(lines) == 1 and lines[0].startswith("attend: --device cuda: no CUDA device"),
       "--device cuda without a GPU: stderr %r" % r.stderr)
    ok(not os.path.exists(probe_out), "--device cuda without a GPU: output written")
    # 16-bit runs go on to look for the GPU too, for every mixer.
    for mixer in ("self", "linear", "vq", "ovq"):
        extra = ["--codebook", codebook] if mixer == "vq" else []
        r = run([mixer, *base, *extra, "--storage", "bf16", "--device", "cuda", "--out",
                 probe_out])
        ok(r.returncode == 1 and "no CUDA device" in r.stderr,
           "--device cuda --storage bf16 (%s) without a GPU: exit %d, stderr %r"
           % (mixer, r.returncode, r.stderr))
    # --head-betas go to the device too; bad ones are refused first, by the CPU layer's checks.
    for mixer in ("self", "ovq"):
        r = run([mixer, *base, "--head-betas", "0.5,1,2,3", "--device", "cuda", "--out",
                 probe_out])
        ok(r.returncode == 1 and "no CUDA device" in r.stderr,
           "--device cuda --head-betas (%s) without a GPU: exit %d, stderr %r"
           % (mixer, r.returncode, r.stderr))
    r = run(["self", *base, "--head-betas", "1,1,-1,1", "--device", "cuda", "--out", probe_out])
    ok(r.returncode == 1 and "betas[2]" in r.stderr and "no CUDA device" not in r.stderr,
       "--device cuda --head-betas 1,1,-1,1: exit %d, stderr %r" % (r.returncode, r.stderr))
else:
    ok(r.returncode == 0, "--device cuda: exit %d, stderr %r" % (r.returncode, r.stderr))
    for dtype in (np.float32, np.float64):
        dn = np.dtype(dtype).name
        for lname, Q, K, V in layouts(dtype):
            tag = "cuda %s %s" % (dn, lname)
            for way in ([], ["--stream"]):
                what = "self window %s %s" % (tag, way)
                O = attend("self", Q, K, V, "--beta", 0.5, "--chunk", 8, "--window", 5,
                           "--device", "cuda", *way, what=what)
                close(O, per_head(Q, K, V, lambda q, k, v, g: ref_self(q, k, v, 0.5, window=5)),
                      dtype, what)
                what = "linear %s %s" % (tag, way)
                O = attend("linear", Q, K, V, "--beta", 0.3, "--chunk", 6, "--feature-map", "elu1",
                           "--normalize", "--device", "cuda", *way, what=what)
                close(O, per_head(Q, K, V, lambda q, k, v, g: ref_linear(q, k, v, 0.3, "elu1", True)),
                      dtype, what)
                C = vq_codebook(K, 7, dtype, False)
                what = "vq %s %s" % (tag, way)
                O = attend("vq", Q, K, V, "--codebook", save(C), "--beta", 0.7, "--chunk", 6,
                           "--device", "cuda", *way, what=what)
                close(O, per_head(Q, K, V, lambda q, k, v, g: ref_vq(q, k, v, 0.7, np.asarray(C, np.float64))),
                      dtype, what)
                Ku = unit_rows(K)
                what = "ovq %s %s" % (tag, way)
                O = attend("ovq", Q, Ku, V, "--growth", "linear", "--capacity", Q.shape[-2],
                           "--chunk", 8, "--beta", 2.0, "--device", "cuda", *way, what=what)
                close(O, per_head(Q, Ku, V, lambda q, k, v, g: ref_self(q, k, v, 2.0)), dtype, what)
    # 16-bit runs of every mixer: float16 inputs, and bf16 storage.
    for lname, Q, K, V in layouts(np.float32):
        for kind in (np.float16, "bf16"):
            args = ["--storage", "bf16"] if kind == "bf16" else []
            Qh, Kh, Vh = ((Q, K, V) if kind == "bf16" else
                          (Q.astype(np.float16), K.astype(np.float16), V.astype(np.float16)))
            Qr, Kr, Vr = ((to_bf16(Q), to_bf16(K), to_bf16(V)) if kind == "bf16" else (Qh, Kh, Vh))
            for way in ([], ["--stream"]):
                what = "self cuda %s %s %s" % (kind if kind == "bf16" else "float16", lname, way)
                O = attend("self", Qh, Kh, Vh, "--beta", 0.5, "--chunk", 8, *args, "--device",
                           "cuda", *way, what=what)
                close(O, per_head(Qr, Kr, Vr, lambda q, k, v, g: ref_self(q, k, v, 0.5)), kind, what)
                what = "linear cuda %s %s %s" % (kind if kind == "bf16" else "float16", lname, way)
                O = attend("linear", Qh, Kh, Vh, "--beta", 0.3, "--chunk", 6, "--feature-map",
                           "elu1", "--normalize", *args, "--device", "cuda", *way, what=what)
                close(O, per_head(Qr, Kr, Vr,
                                  lambda q, k, v, g: ref_linear(q, k, v, 0.3, "elu1", True)),
                      kind, what)
                Ch = vq_codebook(Kr, 7, np.float16 if kind == np.float16 else np.float32, False,
                                 None if kind == np.float16 else to_bf16)
                Cr = Ch
                what = "vq cuda %s %s %s" % (kind if kind == "bf16" else "float16", lname, way)
                O = attend("vq", Qh, Kh, Vh, "--codebook", save(Ch), "--beta", 0.7, "--chunk", 6,
                           *args, "--device", "cuda", *way, what=what)
                close(O, per_head(Qr, Kr, Vr,
                                  lambda q, k, v, g: ref_vq(q, k, v, 0.7, np.asarray(Cr, np.float64))),
                      kind, what)
                # OVQ with a dictionary that holds every key: self-attention over the 16-bit keys.
                Ku = unit_rows(K)
                Kuh = Ku.astype(np.float16) if kind == np.float16 else Ku
                Kur = Kuh if kind == np.float16 else to_bf16(Ku)
                what = "ovq cuda %s %s %s" % (kind if kind == "bf16" else "float16", lname, way)
                O = attend("ovq", Qh, Kuh, Vh, "--growth", "linear", "--capacity", Q.shape[-2],
                           "--chunk", 8, "--beta", 2.0, *args, "--device", "cuda", *way, what=what)
                close(O, per_head(Qr, Kur, Vr, lambda q, k, v, g: ref_self(q, k, v, 2.0)), kind,
                      what)
    # --head-betas: each query head's own scale, as on the CPU.
    Qg, Kg, Vg = layouts(np.float32)[0][1:]
    for mixer, opts in (("self", ["--chunk", 4]), ("ovq", ["--capacity", 12, "--chunk", 5]),
                        ("ovq", ["--preset", "kvm-delta", "--capacity", 12, "--chunk", 5])):
        betas = "0.5,0.5,2,2" if "kvm-delta" in opts else "0.5,1,2,3"
        for way in ([], ["--stream"]):
            what = "%s %s --head-betas %s cuda %s" % (mixer, opts, betas, way)
            O = attend(mixer, Qg, Kg, Vg, *opts, "--head-betas", betas, "--device", "cuda", *way,
                       what=what)
            want = attend(mixer, Qg, Kg, Vg, *opts, "--head-betas", betas, *way, what=what + " cpu")
            if want is not None:
                close(O, want, np.float32, what)

# Zero tokens is a valid (empty) sequence.
for mixer in ("self", "linear", "ovq"):
    O = attend(mixer, np.zeros((2, 0, 4)), np.zeros((1, 0, 4)), np.zeros((1, 0, 3)), "--stream",
               what="%s with T = 0" % mixer)

print("%d checks passed, %d failed" % (passed, len(failed)))
sys.exit(1 if failed else 0)
PYEOF
status=$?
if [ "$status" -ne 0 ]; then
  echo "test_attend: FAILED (exit $status)"
  exit 1
fi
echo "test_attend: all checks passed"
exit 0
