"""The Python row of scripts/bench: ovq from PyTorch, in one process.

  1. Per-call overhead of a decode step (a tiny windowed self-attention step on one thread,
     H = 1, d = 16, 8 cached rows, which costs well under a microsecond): the same step through
     ovq.torch's layer (eager), through the registered op's overload torch.ops.ovq.step.default
     (what torch.compile's generated code calls), and through ovq.MultiHead, against the step
     looped in C++.
     Overhead = per-call time - the C++ loop's per-call time. Goal: under 10 us.
  2. ovq against torch.nn.functional.scaled_dot_product_attention on the same tensors:
     causal prefill T = 4096, d = 128, H = 8; decode at a 64k context with 8/8 and 32/8 heads.
     Goal: ovq faster on every row.

Each time is the best of --repetitions runs of at least --min-time seconds. Writes --out (JSON).

  python scripts/lib/bench_python.py --out DIR/python.json --threads 2 [--quick]
"""

import argparse
import json
import math
import platform
import time

import torch
import torch.nn.functional as F

import ovq
import ovq.torch as otorch


def best_time(fn, min_time, repetitions, per_call=1):
    """Best seconds per call of fn over `repetitions` runs of at least min_time each."""
    fn()
    best = math.inf
    for _ in range(repetitions):
        calls, start = 0, time.perf_counter()
        while True:
            fn()
            calls += per_call
            took = time.perf_counter() - start
            if took >= min_time:
                break
        best = min(best, took / calls)
    return best


def overhead(args):
    # A tiny step on one thread: no OpenMP fork and join on either side of the subtraction, and
    # a step whose own variation is far below the call paths' costs.
    heads, d, window, threads = 1, 16, 8, 1
    layer = otorch.SelfAttention(1, heads, heads, d, d, window=window, threads=threads)
    g = torch.Generator().manual_seed(0)
    layer.absorb(torch.randn(1, heads, window, d, generator=g),
                 torch.randn(1, heads, window, d, generator=g))
    q, k, v = (torch.randn(1, heads, d, generator=g) for _ in range(3))
    out = torch.empty(1, heads, d)
    iters = 20000
    impl = layer.layer._impl
    step_op = torch.ops.ovq.step.default  # the overload Inductor's generated code calls
    cxx = min(impl._time_steps(q, k, v, out, iters, threads) for _ in range(args.repetitions))
    rows = {
        "C++ loop (MultiHead::step)": cxx,
        "ovq.MultiHead.step": best_time(lambda: layer.layer.step(q, k, v, out=out,
                                                                 threads=threads),
                                        args.min_time, args.repetitions),
        "ovq.torch layer.step (eager)": best_time(lambda: layer.step(q, k, v), args.min_time,
                                                  args.repetitions),
        f"torch.ops.ovq.step.default (what compiled code calls; "
        f"{'C++' if otorch.NATIVE_OPS else 'Python'} op)": best_time(
            lambda: step_op(layer.handle, q, k, v, threads), args.min_time,
            args.repetitions),
    }
    return [{"path": name, "us_per_call": 1e6 * t, "overhead_us": 1e6 * (t - cxx)}
            for name, t in rows.items()]


def versus_sdpa(args):
    g = torch.Generator().manual_seed(1)
    d = 128
    scale = 1 / math.sqrt(d)
    cases = []

    # Causal prefill, T = 4096, H = 8: ovq from an empty state each call.
    t, h = 4096, 8
    q, k, v = (torch.randn(1, h, t, d, generator=g) for _ in range(3))
    layer = otorch.SelfAttention(1, h, h, d, d, beta=scale, threads=args.threads)

    def ovq_prefill():
        layer.reset()
        layer(q, k, v)

    cases.append(("prefill causal T=4096 d=128 H=8",
                  best_time(ovq_prefill, args.min_time, args.repetitions),
                  best_time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                            args.min_time, args.repetitions)))

    # Decode at a 64k context (the cache grows by the timed steps: under 0.5% of 65536).
    ctx = 65536 if not args.quick else 65536
    for hq, hkv in ((8, 8), (32, 8)):
        kc = torch.randn(1, hkv, ctx, d, generator=g)
        vc = torch.randn(1, hkv, ctx, d, generator=g)
        layer = otorch.SelfAttention(1, hq, hkv, d, d, beta=scale, threads=args.threads)
        layer.absorb(kc, vc)
        q1 = torch.randn(1, hq, d, generator=g)
        k1 = torch.randn(1, hkv, d, generator=g)
        v1 = torch.randn(1, hkv, d, generator=g)
        steps = [0]

        def ovq_step():
            steps[0] += 1
            if steps[0] > 256:  # keep the context within 0.4% of 64k
                raise RuntimeError("decode benchmark took more steps than planned")
            layer.step(q1, k1, v1)

        q4 = q1.unsqueeze(2)
        ours = best_time(ovq_step, args.decode_min_time, args.repetitions)
        theirs = best_time(
            lambda: F.scaled_dot_product_attention(q4, kc, vc, enable_gqa=hq != hkv),
            args.decode_min_time, args.repetitions)
        cases.append((f"decode ctx=64k d=128 Hq={hq} Hkv={hkv}", ours, theirs))
    return [{"case": name, "ovq_ms": 1e3 * a, "torch_ms": 1e3 * b, "torch_over_ovq": b / a}
            for name, a, b in cases]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--min-time", type=float, default=0.3)
    p.add_argument("--decode-min-time", type=float, default=0.05)
    p.add_argument("--repetitions", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with torch.no_grad():
        over = overhead(args)
        sdpa = versus_sdpa(args)
    result = {
        "context": {"torch": torch.__version__, "threads": args.threads, "ovq_simd": ovq.simd,
                    "python": platform.python_version(), "native_ops": otorch.NATIVE_OPS},
        "overhead": over,
        "sdpa": sdpa,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for row in over:
        print(f"{row['path']:48s} {row['us_per_call']:9.2f} us  overhead {row['overhead_us']:7.2f} us")
    for row in sdpa:
        print(f"{row['case']:40s} ovq {row['ovq_ms']:9.3f} ms  torch {row['torch_ms']:9.3f} ms"
              f"  torch/ovq {row['torch_over_ovq']:.2f}")


if __name__ == "__main__":
    main()
