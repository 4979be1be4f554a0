#!/usr/bin/env python3
"""PyTorch's scaled_dot_product_attention on the shapes of bench/cuda/bench_cuda.cu, timed the
same way (CUDA events, median of the repetitions after one untimed call), one JSON line per case.

    python3 scripts/lib/gpu_peers.py [--quick] [--json FILE]
"""
import argparse
import json
import statistics
import sys


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        print("gpu_peers: no PyTorch here", file=sys.stderr)
        return 77
    if not torch.cuda.is_available():
        print("gpu_peers: PyTorch sees no GPU", file=sys.stderr)
        return 77
    scale = 4 if args.quick else 1
    h, d = 32, 128

    def time_ms(fn, reps):
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        return statistics.median(times)

    rows = []
    for dtype, name in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
        t = 16384 // scale
        q, k, v = (torch.randn(1, h, t, d, device="cuda", dtype=dtype) for _ in range(3))
        ms = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), 3)
        tflops = 2.0 * h * (t * (t + 1) / 2) * (2 * d) / ms / 1e9
        rows.append({"case": f"torch_sdpa_prefill_{name} T=16384 d=128 H=32", "ms": ms,
                     "value": tflops, "unit": "TFLOP/s"})
        del q, k, v
        ctx = 131072 // scale
        q = torch.randn(1, h, 1, d, device="cuda", dtype=dtype)
        k, v = (torch.randn(1, h, ctx, d, device="cuda", dtype=dtype) for _ in range(2))
        ms = time_ms(lambda: F.scaled_dot_product_attention(q, k, v), 5)
        gbs = h * ctx * 2 * d * k.element_size() / ms / 1e6
        rows.append({"case": f"torch_sdpa_decode_{name} ctx=128k H=32 d=128", "ms": ms,
                     "value": gbs, "unit": "GB/s"})
        del q, k, v
    torch.cuda.empty_cache()
    print("| case | time (ms) | value | unit |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['ms']:.3f} | {r['value']:.2f} | {r['unit']} |")
    if args.json:
        with open(args.json, "w") as out:
            for r in rows:
                out.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
