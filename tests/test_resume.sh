#!/usr/bin/env bash
# Streams cut, saved and resumed by a new process, through the `attend` tool (examples/attend.cpp).
#
#   bash tests/test_resume.sh path/to/attend
#
# For every mixer (self, windowed self, linear, vq, ovq) in float32 and float64, with grouped
# query heads: attend runs the whole stream once (--save-state), then, for cuts at 1, L - 1, L,
# L + 1, mid-chunk, a later mid-chunk point and T - 1, it runs the prefix with --save-state and
# the suffix in a new process with --load-state --save-state. Checked:
#   - bitwise, the resumed run against the same cut made inside one process (--split c,T-c):
#     saving and loading must change nothing at all, in the outputs or in the final state file;
#   - bitwise, the resumed run against the uncut run: the concatenated outputs, the final state
#     files, and what both final states do next (L + 3 more tokens). Every mixer computes each
#     output in an order that does not depend on where the stream was cut (docs/math.md, "Same
#     bits however the stream is cut").
# Also: --load-state refuses a state of another mixer, option, dtype, head count or codebook, a
# corrupted or missing file, with exit status 1 and one "attend: " line naming the problem.
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

WORK=$(mktemp -d "${TMPDIR:-/tmp}/test_resume.XXXXXX") || exit 1
trap 'rm -rf "$WORK"' EXIT

"$PYTHON" - "$ATTEND" "$WORK" <<'PYEOF'
import os
import subprocess
import sys

import numpy as np

ATTEND, WORK = sys.argv[1], sys.argv[2]
L = 8                 # --chunk for every mixer
T = 3 * L + 5         # the stream: three chunks and a partial one
E = L + 3             # tokens after the stream, to compare what two final states do next
HQ, HKV, DK, DV = 4, 2, 8, 5
CUTS = sorted({1, L - 1, L, L + 1, L + L // 2, 2 * L + 3, T - 1})

failures = []
passed = [0]
counter = [0]


def ok(cond, what):
    if cond:
        passed[0] += 1
    else:
        failures.append(what)
        print("FAIL:", what)
    return cond


def fresh(stem, ext):
    counter[0] += 1
    return os.path.join(WORK, "%s_%d%s" % (stem, counter[0], ext))


def save(arr, stem="in"):
    p = fresh(stem, ".npy")
    np.save(p, np.ascontiguousarray(arr))
    return p


def run(args):
    return subprocess.run([ATTEND] + [str(a) for a in args], capture_output=True, text=True,
                          timeout=300)


def unit_rows(rng, shape, dtype):
    x = rng.standard_normal(shape)
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(dtype)


# Mixer configurations: name and attend arguments (the codebook is added for vq).
CONFIGS = [
    ("self", ["self", "--beta", "0.7"]),
    ("self, window 6", ["self", "--window", "6"]),
    ("linear", ["linear", "--feature-map", "elu1", "--normalize", "--decay", "0.95"]),
    ("linear, unnormalised", ["linear", "--feature-map", "relu", "--beta", "0.5"]),
    ("vq", ["vq", "--beta", "1.5"]),
    ("ovq", ["ovq", "--capacity", "6", "--beta", "2"]),
    ("ovq, linear growth, random seeding",
     ["ovq", "--capacity", "9", "--growth", "linear", "--rate", "0.5", "--seeding", "random",
      "--seed", "7", "--lr", "constant", "--eta", "0.3"]),
]


class Stream:
    """Inputs of one configuration, their files, and the uncut run."""

    def __init__(self, name, args, dtype, seed):
        rng = np.random.default_rng(seed)
        self.name, self.dtype = name, dtype
        self.q = unit_rows(rng, (HQ, T + E, DK), dtype)
        self.k = unit_rows(rng, (HKV, T + E, DK), dtype)
        self.v = rng.standard_normal((HKV, T + E, DV)).astype(dtype)
        self.args = list(args) + ["--chunk", L]
        if args[0] == "vq":
            self.codebook = save(unit_rows(rng, (HKV, 6, DK), dtype), "codebook")
            self.args += ["--codebook", self.codebook]

    def attend(self, t0, t1, extra, what):
        """Runs tokens [t0, t1) in one process; returns O or None."""
        out = fresh("out", ".npy")
        r = run(self.args + ["--q", save(self.q[:, t0:t1]), "--k", save(self.k[:, t0:t1]),
                             "--v", save(self.v[:, t0:t1]), "--out", out] + list(extra))
        if not ok(r.returncode == 0 and r.stderr == "",
                  "%s: exit %d, stderr %r" % (what, r.returncode, r.stderr)):
            return None
        o = np.load(out)
        ok(o.dtype == self.dtype and o.shape == (HQ, t1 - t0, DV),
           "%s: O is %s %s" % (what, o.dtype, o.shape))
        return o


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def same_bits(a, b):
    return a is not None and b is not None and a.dtype == b.dtype and a.shape == b.shape and \
        a.tobytes() == b.tobytes()


def max_diff(a, b):
    if a is None or b is None or a.shape != b.shape:
        return float("inf")
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))


def check_stream(s):
    tag = "%s %s" % (s.name, np.dtype(s.dtype).name)
    full_state = fresh("full", ".state")
    full = s.attend(0, T, ["--save-state", full_state], tag + ": uncut run")
    if full is None:
        return
    full_bytes = read_bytes(full_state)
    # What the uncut run's final state does next.
    full_next = s.attend(T, T + E, ["--load-state", full_state], tag + ": after the uncut run")
    for c in CUTS:
        what = "%s, cut at %d" % (tag, c)
        # The same cut inside one process: what saving and loading must reproduce exactly.
        split_state = fresh("split", ".state")
        split = s.attend(0, T, ["--split", "%d,%d" % (c, T - c), "--save-state", split_state],
                         what + ": --split run")
        # The cut across two processes.
        a_state, b_state = fresh("a", ".state"), fresh("b", ".state")
        a = s.attend(0, c, ["--save-state", a_state], what + ": prefix")
        if a is None:
            continue
        b = s.attend(c, T, ["--load-state", a_state, "--save-state", b_state], what + ": suffix")
        if b is None:
            continue
        resumed = np.concatenate([a, b], axis=1)
        resumed_bytes = read_bytes(b_state)
        if split is not None:
            ok(same_bits(resumed, split),
               "%s: resumed outputs differ from the same cut in one process (max |diff| %.3g)"
               % (what, max_diff(resumed, split)))
            ok(resumed_bytes == read_bytes(split_state),
               "%s: resumed final state differs from the same cut in one process" % what)
        resumed_next = s.attend(T, T + E, ["--load-state", b_state], what + ": after the resume")
        ok(same_bits(resumed, full),
           "%s: resumed outputs differ from the uncut run (max |diff| %.3g)"
           % (what, max_diff(resumed, full)))
        ok(resumed_bytes == full_bytes,
           "%s: resumed final state file differs from the uncut run's" % what)
        ok(same_bits(resumed_next, full_next),
           "%s: the resumed and the uncut final states continue differently (max |diff| %.3g)"
           % (what, max_diff(resumed_next, full_next)))


def check_refusals():
    """--load-state refuses what does not belong to the run."""
    rng = np.random.default_rng(99)
    q = unit_rows(rng, (HQ, 10, DK), np.float32)
    k = unit_rows(rng, (HKV, 10, DK), np.float32)
    v = rng.standard_normal((HKV, 10, DV)).astype(np.float32)
    qp, kp, vp = save(q), save(k), save(v)
    state = fresh("ovq", ".state")
    base = ["ovq", "--capacity", "6", "--chunk", L, "--q", qp, "--k", kp, "--v", vp]
    r = run(base + ["--out", fresh("out", ".npy"), "--save-state", state])
    if not ok(r.returncode == 0, "refusals: saving failed: %r" % r.stderr):
        return

    def refused(args, pieces, what, status=1):
        out = fresh("out", ".npy")
        r = run(args + ["--out", out])
        lines = r.stderr.splitlines()
        good = (r.returncode == status and len(lines) == 1 and lines[0].startswith("attend: ")
                and all(p in lines[0] for p in pieces) and not os.path.exists(out))
        ok(good, "refusals: %s: exit %d, stderr %r (expected %d and %r)"
           % (what, r.returncode, r.stderr, status, pieces))

    refused(base[:2] + ["9"] + base[3:] + ["--load-state", state], ["option 'capacity'"],
            "another capacity")
    refused(base[:4] + ["16"] + base[5:] + ["--load-state", state], ["option 'chunk'"],
            "another chunk")
    refused(base + ["--beta", "2", "--load-state", state], ["option 'beta'"], "another beta")
    refused(["linear"] + base[3:] + ["--load-state", state], ["mixer kind 4, expected 2"],
            "another mixer")
    qd, kd, vd = save(q.astype(np.float64)), save(k.astype(np.float64)), save(v.astype(np.float64))
    refused(base[:5] + ["--q", qd, "--k", kd, "--v", vd, "--load-state", state],
            ["scalar type of 4 bytes, expected 8"], "float32 state, float64 run")
    q2 = save(unit_rows(rng, (2, 10, DK), np.float32))
    k1 = save(unit_rows(rng, (1, 10, DK), np.float32))
    v1 = save(rng.standard_normal((1, 10, DV)).astype(np.float32))
    refused(base[:5] + ["--q", q2, "--k", k1, "--v", v1, "--load-state", state],
            ["(batch, query heads, kv heads) = (1, 4, 2)", "expected (1, 2, 1)"],
            "other head counts")
    v2 = save(rng.standard_normal((HKV, 10, DV + 1)).astype(np.float32))
    refused(base[:5] + ["--q", qp, "--k", kp, "--v", v2, "--load-state", state],
            ["(dk, dv)"], "another dv")
    refused(base + ["--load-state", os.path.join(WORK, "no_such.state")], ["cannot open"],
            "missing file")
    data = bytearray(read_bytes(state))
    data[len(data) // 2] ^= 0x10
    bad = fresh("corrupt", ".state")
    with open(bad, "wb") as f:
        f.write(bytes(data))
    refused(base + ["--load-state", bad], ["checksum"], "corrupted file")
    with open(bad, "wb") as f:
        f.write(read_bytes(state)[:50])
    refused(base + ["--load-state", bad], ["truncated"], "truncated file")
    refused(base + ["--load-state", ""], ["--load-state: empty path"], "empty path", status=2)
    refused(base + ["--save-state", ""], ["--save-state: empty path"], "empty path", status=2)
    refused(base + ["--save-state", os.path.join(WORK, "no", "dir", "x.state")],
            ["cannot create temporary file"], "unwritable --save-state")

    # vq: the codebook in the state must be the one given.
    cb = save(unit_rows(rng, (HKV, 6, DK), np.float32), "codebook")
    cb_other = save(unit_rows(rng, (HKV, 6, DK), np.float32), "codebook")
    vq = ["vq", "--chunk", L, "--q", qp, "--k", kp, "--v", vp]
    vq_state = fresh("vq", ".state")
    r = run(vq + ["--codebook", cb, "--out", fresh("out", ".npy"), "--save-state", vq_state])
    if ok(r.returncode == 0, "refusals: vq save failed: %r" % r.stderr):
        refused(vq + ["--codebook", cb_other, "--load-state", vq_state], ["another codebook"],
                "vq with another codebook")
        r = run(vq + ["--codebook", cb, "--out", fresh("out", ".npy"), "--load-state", vq_state])
        ok(r.returncode == 0 and r.stderr == "", "refusals: vq with its codebook: %r" % r.stderr)


def check_help():
    r = run(["--help"])
    ok(r.returncode == 0 and "--save-state F" in r.stdout and "--load-state F" in r.stdout,
       "--help documents --save-state and --load-state")


check_help()
seed = 1
for name, args in CONFIGS:
    for dtype in (np.float32, np.float64):
        check_stream(Stream(name, args, dtype, seed))
        seed += 1
check_refusals()

print("%d checks passed, %d failed" % (passed[0], len(failures)))
sys.exit(1 if failures else 0)
PYEOF
