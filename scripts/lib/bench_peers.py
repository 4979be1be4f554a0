#!/usr/bin/env python3
"""PyTorch's scaled_dot_product_attention on the CPU, on the shapes, dtypes and threads of ovq's
self-attention benchmarks (bench/bench_self_attention.cpp), for the side-by-side table of
scripts/bench --peers.

    bench_peers.py --out FILE [--threads N] [--min-time S] [--repetitions R] [--quick]

Every case is named as the ovq case it stands beside (BM_SelfAttention_prefill/T:4096/d:128/H:8,
.../elem:bf16, BM_SelfAttention_decode/ctx:65536/d:128/Hq:32/Hkv:8, ...), so the report joins
them by name. Timing follows Google Benchmark's: one untimed call, then calls in a loop for at
least --min-time seconds, the mean of that loop one repetition; the file keeps every repetition
and the report the fastest.

Prefill: causal attention over q, k, v of shape (1, H, T, d), contiguous (PyTorch's own layout).
Decode: one query row a head against a cache preallocated to the context plus one row; a step
writes the new key and value row into it and attends over all of it (enable_gqa for grouped
heads), the same bytes an ovq step reads.

Writes FILE as JSON: {"context": {...}, "benchmarks": [{"name", "time_ms", "repetition",
"dtype", "threads"}]}. Exits 77 when PyTorch cannot be imported.
"""

import argparse
import json
import platform
import sys
import time

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def cases(quick):
    """(name, kind, shape, dtype): kind "prefill" (T, d, Hq, Hkv) or "decode" (ctx, d, Hq, Hkv)."""
    out = []

    def name(phase, first, d, hq, hkv, elem):
        heads = f"H:{hq}" if hq == hkv else f"Hq:{hq}/Hkv:{hkv}"
        key = "T" if phase == "prefill" else "ctx"
        suffix = "" if elem == "fp32" else f"/elem:{elem}"
        return f"BM_SelfAttention_{phase}/{key}:{first}/d:{d}/{heads}{suffix}"

    for elem in ("fp32", "bf16", "fp16"):
        out.append((name("prefill", 4096, 128, 8, 8, elem), "prefill", (4096, 128, 8, 8), elem))
    if not quick:
        out.append((name("prefill", 4096, 64, 8, 8, "fp32"), "prefill", (4096, 64, 8, 8), "fp32"))
        out.append((name("prefill", 4096, 128, 32, 8, "fp32"), "prefill", (4096, 128, 32, 8),
                    "fp32"))
    for ctx in (4096, 65536):
        for hq, elems in ((8, ("fp32", "bf16", "fp16")), (32, ("fp32", "bf16"))):
            for elem in elems:
                out.append((name("decode", ctx, 128, hq, 8, elem), "decode", (ctx, 128, hq, 8),
                            elem))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=0, help="0: PyTorch's default")
    ap.add_argument("--min-time", type=float, default=0.2)
    ap.add_argument("--repetitions", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    try:
        import torch
        import torch.nn.functional as F
    except ImportError as e:
        print(f"bench_peers: PyTorch is not available ({e})", file=sys.stderr)
        return 77
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    gen = torch.Generator().manual_seed(20261201)

    def randn(*shape, dtype):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype)

    def repetition(fn):
        fn()
        calls, start = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            elapsed = time.perf_counter() - start
            if elapsed >= args.min_time:
                return elapsed / calls * 1e3

    results = []
    for name, kind, (n, d, hq, hkv), elem in cases(args.quick):
        dtype = getattr(torch, DTYPES[elem])
        if kind == "prefill":
            q = randn(1, hq, n, d, dtype=dtype)
            k, v = randn(1, hkv, n, d, dtype=dtype), randn(1, hkv, n, d, dtype=dtype)

            def call(q=q, k=k, v=v, gqa=hq != hkv):
                F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            q = randn(1, hq, 1, d, dtype=dtype)
            k_cache = randn(1, hkv, n + 1, d, dtype=dtype)
            v_cache = randn(1, hkv, n + 1, d, dtype=dtype)
            k_new, v_new = randn(1, hkv, 1, d, dtype=dtype), randn(1, hkv, 1, d, dtype=dtype)

            def call(q=q, kc=k_cache, vc=v_cache, kn=k_new, vn=v_new, gqa=hq != hkv):
                kc[:, :, -1:] = kn
                vc[:, :, -1:] = vn
                F.scaled_dot_product_attention(q, kc, vc, enable_gqa=gqa)
        with torch.inference_mode():
            for rep in range(args.repetitions):
                ms = repetition(call)
                results.append({"name": name, "time_ms": ms, "repetition": rep, "dtype": elem,
                                "threads": threads})
                print(f"{name:<58} {ms:10.3f} ms  (torch SDPA, {threads} threads)", flush=True)
    context = {
        "torch_version": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": threads,
        "machine": platform.machine(),
        "python": platform.python_version(),
    }
    with open(args.out, "w") as f:
        json.dump({"context": context, "benchmarks": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
