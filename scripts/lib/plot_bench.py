#!/usr/bin/env python3
"""Report and plots for the ovq benchmarks (called by scripts/bench).

    plot_bench.py DIR [--mode quick|full] [--run-seconds S] [--build-seconds S] [--commit C]

Reads DIR/bench_<mixer>.json (Google Benchmark), the paired decode runs
DIR/bench_<mixer>.paired.json (the decode cases of the headline's time ratios, their
repetitions interleaved at random; merged with the binary's results), the thread-scaling rounds
DIR/bench_<mixer>.scaling<R>.json (cases named .../nthreads:<count>; rounds written before the
thread counts shared a process, DIR/bench_<mixer>.scaling<R>.t<N>.json, are read too) and
DIR/bench_ovq_memory.json, and, from --peers, DIR/peers_torch.json, and writes DIR/report.md
with the headline tables (measured value, target, pass/fail) and every result, DIR/summary.md (the
run's facts and goal tables; --readme FILE copies it into FILE's results block), plus DIR/prefill.png and DIR/decode.png when matplotlib is
available (the report says so when it is not). Only the standard library is needed otherwise.
"""

import argparse
import glob
import json
import math
import os
import platform
import re
import sys

# Targets of the headline table: the bar this project sets itself for fp32 on the benchmark
# machine (2 cores). Ratios are measured against cases of the same run.
TARGETS = {
    # The performance issue's bar (fp32, 2 threads, Release, ratios from one run).
    "self_frac_d128": 0.70,  # self-attention prefill, causal, T=4096 d=128 H=8: frac_sgemm >=
    "self_frac_d64": 0.60,  # same at d=64: frac_sgemm >=
    "ovq_frac": 0.60,  # OVQ prefill T=32768 N=2048 L=128 d=128 H=8: frac_sgemm >=
    "ovq_linear_in_t": 1.10,  # OVQ time per token, T=65536 over T=16384: <=
    "ovq_vs_self_prefill": 4.0,  # self-attention / OVQ prefill time per head at T=32768: >=
    "linear_frac": 0.50,  # linear chunked prefill T=2048 d=128 H=8, best chunk: frac_sgemm >=
    "gqa_decode": 1.2,  # self-attention decode Hq/Hkv = 32/8 over 8/8 at ctx 4k and 64k: <=
    "window_decode": 1.1,  # sliding-window decode W=4096 after 64k tokens over a 4k cache: <=
    "ovq_decode_flat": 1.10,  # OVQ decode N=2048, ctx 64k over ctx 4k: <=
    "ovq_vs_self_decode": 10.0,  # self-attention / OVQ decode step at ctx 64k: >=
    "threads": 0.95,  # prefill, 2 threads over 1, every case, over sgemm's in its processes: >=
    # Against the machine's own ceilings and 16-bit storage (same shapes as above).
    "self_frac_peak": 0.70,  # fp32 self-attention prefill T=4096 d=128 H=8: frac_peak >=
    "self_vs_torch": 1.2,  # the same: PyTorch SDPA fp32 time / ours >=
    "bf16_vs_fp32_prefill": 1.6,  # bf16 prefill, same shape, with AVX512-BF16: speedup >=
    "bf16_vs_torch": 2.0,  # the same: PyTorch SDPA bf16 time / ours >=
    "decode_frac_bandwidth": 0.85,  # self decode ctx 64k H=8, fp32 and 16-bit: frac_bandwidth >=
    "half_vs_fp32_decode": 1.8,  # the same with a bf16 or fp16 cache: speedup over fp32 >=
    "ovq_bf16_decode": 1.6,  # OVQ decode at capacity ctx 64k N=2048, bf16 over fp32: speedup >=
    "ovq_frac_peak": 0.55,  # OVQ prefill T=32768 N=2048 L=128 d=128 H=8: frac_peak >=
}

MIXERS = [
    # (label, family prefix, extra arguments that pick the main curve)
    ("self-attention", "BM_SelfAttention", {}),
    ("linear (L=64)", "BM_LinearAttention", {"L": 64}),
    ("VQ (S=2048, L=128)", "BM_VQ", {"S": 2048, "L": 128}),
    ("OVQ (N=2048, L=128)", "BM_OVQ", {"N": 2048, "L": 128}),
]

TO_MS = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}


# ------------------------------------------------------------------------------------------------
# Loading
# ------------------------------------------------------------------------------------------------


class Result:
    def __init__(self, raw, source):
        self.raw = raw
        self.source = source
        self.full_name = raw["name"]
        parts = self.full_name.split("/")
        self.family = parts[0]
        self.args = {}
        flags = []
        for p in parts[1:]:
            if ":" in p:
                k, v = p.split(":", 1)
                try:
                    self.args[k] = int(v)
                except ValueError:
                    self.args[k] = v
            else:
                flags.append(p)
        # The name as the issue spells it: without Google Benchmark's /real_time and friends.
        # nthreads (the thread-scaling runs' thread count) is kept in `nthreads`, not the name.
        self.name = "/".join([self.family] + [f"{k}:{v}" for k, v in self.args.items()
                                              if k not in ("iterations", "min_time", "repeats",
                                                           "nthreads")])
        self.nthreads = self.args.get("nthreads")
        self.error = raw.get("error_occurred", False)
        self.error_message = raw.get("error_message", "")
        self.paired = False  # from a paired decode run (set by load)
        self.time_ms = raw.get("real_time", float("nan")) * TO_MS.get(raw.get("time_unit", "ns"),
                                                                    1e-6)
        self.iterations = raw.get("iterations", 0)
        self.repetitions = 1

    def counter(self, key, default=float("nan")):
        return self.raw.get(key, default)

    @property
    def hq(self):
        return self.args.get("H", self.args.get("Hq", 1))

    @property
    def hkv(self):
        return self.args.get("H", self.args.get("Hkv", 1))

    @property
    def base_family(self):
        """The family without the "_full" of OVQ's at-capacity cases."""
        return self.family[:-len("_full")] if self.family.endswith("_full") else self.family

    @property
    def phase(self):
        return self.base_family.rsplit("_", 1)[-1]

    @property
    def mixer(self):
        return self.base_family.rsplit("_", 1)[0]

    def flops(self):
        """FLOPs of one iteration: GFLOPS is a rate over real time."""
        return self.counter("GFLOPS") * 1e9 * self.time_ms / 1e3


def load_runs(path):
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        return None, [], f"{os.path.basename(path)}: {e}"
    results = [Result(b, os.path.basename(path)) for b in data.get("benchmarks", [])
               if b.get("run_type", "iteration") == "iteration"]
    return data.get("context", {}), results, None


SGEMM_FAMILY = "BM_Peak_sgemm"


def rebase_frac_sgemm(results):
    """Divides every case of one process by the best reference rates of that whole process.

    The binaries' counters divide by the best rate measured so far when the case ran (the
    first measurement alone, or none yet for a case that ran before its ceiling in a run
    interleaved at random); every BM_Peak_* case also runs after the cases (/at:end). Here each
    counter divides by the best of all of them in the process: frac_sgemm by BM_Peak_sgemm's
    GFLOPS (and every case's own sgemm_GFLOPS), frac_peak by BM_Peak_fma's, frac_bf16_peak by
    BM_Peak_bf16dot's, frac_bandwidth (read_GBps over it) by BM_Peak_read's GBps. So a counter
    here is never above the binary's, and a process whose first measurement ran while another
    tenant held the cores keeps a fair reference.
    """
    def best(family, key):
        rates = [r.counter(key) for r in results
                 if r.family == family and not r.error and r.counter(key, 0) > 0]
        return max(rates) if rates else None

    sgemm = [r.counter("sgemm_GFLOPS") for r in results
             if not r.error and r.counter("sgemm_GFLOPS", 0) > 0]
    sgemm_ref = max([x for x in [best(SGEMM_FAMILY, "GFLOPS")] if x] + sgemm, default=None)
    fma, bf16, read = (best("BM_Peak_fma", "GFLOPS"), best("BM_Peak_bf16dot", "GFLOPS"),
                       best("BM_Peak_read", "GBps"))
    for r in results:
        if r.error or r.family.startswith("BM_Peak_"):
            continue
        gflops = r.counter("GFLOPS")
        if sgemm_ref and "frac_sgemm" in r.raw and not math.isnan(gflops):
            r.raw["frac_sgemm"] = gflops / sgemm_ref
            r.raw["sgemm_GFLOPS"] = sgemm_ref
        if "read_GBps" in r.raw:
            if read:
                r.raw["frac_bandwidth"] = r.counter("read_GBps") / read
        elif r.phase == "prefill":
            if fma and not math.isnan(gflops):
                r.raw["frac_peak"] = gflops / fma
            if bf16 and "frac_bf16_peak" in r.raw:
                r.raw["frac_bf16_peak"] = gflops / bf16


# Round R of the thread-scaling comparison: both thread counts in one process (names ending in
# /nthreads:<count>), or, from runs before that, one process per thread count (.t<N>).
SCALING_FILE = re.compile(r"^(bench_\w+)\.scaling(\d+)(?:\.t(\d+))?\.json$")
# The paired decode runs: cases the main run of the binary leaves out.
PAIRED_FILE = re.compile(r"^(bench_\w+)\.paired\.json$")


def load(directory):
    """main: {(binary, name): Result};
    scaling: {name: {threads: {round: [Result, one per repetition]}}}."""
    main, scaling, contexts, problems = {}, {}, {}, []
    for path in sorted(glob.glob(os.path.join(directory, "bench_*.json"))):
        base = os.path.basename(path)
        if base == "bench_ovq_memory.json":
            continue
        context, results, problem = load_runs(path)
        if problem:
            problems.append(problem)
            continue
        m = SCALING_FILE.match(base)
        if m:
            binary, round_ = m.group(1), int(m.group(2))
            for r in results:
                threads = int(m.group(3)) if m.group(3) else r.nthreads
                if not r.error and isinstance(threads, int):
                    (scaling.setdefault(r.name, {}).setdefault(threads, {})
                     .setdefault((binary, round_), []).append(r))
            continue
        paired = bool(PAIRED_FILE.match(base))
        if not paired:
            contexts[base] = context
        rebase_frac_sgemm(results)
        for r in results:
            # A paired run's ceilings served its own cases (above); the main run has its own.
            if paired and r.family.startswith("BM_Peak_"):
                continue
            r.paired = paired
            # Repetitions (--benchmark_repetitions) give a case several results: the best time
            # is kept, with how many there were.
            key = (base.split(".")[0], r.name)
            kept = main.get(key)
            r.repetitions = 1 + (kept.repetitions if kept else 0)
            if kept is None or kept.error or (not r.error and r.time_ms < kept.time_ms):
                main[key] = r
            else:
                kept.repetitions = r.repetitions
    memory = None
    mpath = os.path.join(directory, "bench_ovq_memory.json")
    if os.path.exists(mpath):
        try:
            with open(mpath) as f:
                memory = json.load(f)
        except (OSError, ValueError) as e:
            problems.append(f"bench_ovq_memory.json: {e}")
    return main, scaling, contexts, memory, problems


def by_name(results):
    return {name: r for (_, name), r in results.items() if not r.error}


# ------------------------------------------------------------------------------------------------
# Formatting
# ------------------------------------------------------------------------------------------------


def fmt(x, digits=3):
    if x is None or (isinstance(x, float) and (math.isnan(x) or math.isinf(x))):
        return "n/a"
    if isinstance(x, int):
        return str(x)
    if x == 0:
        return "0"
    mag = abs(x)
    if mag >= 1e4 or mag < 1e-3:
        return f"{x:.{digits - 1}e}"
    return f"{x:.{max(digits - 1 - int(math.floor(math.log10(mag))), 0)}f}"


def fmt_bytes(b):
    if b is None or (isinstance(b, float) and math.isnan(b)):
        return "n/a"
    b = float(b)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if b < 1024 or unit == "GiB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.2f} {unit}"
        b /= 1024


def verdict(value, target, kind):
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "not measured"
    ok = value >= target if kind == ">=" else value <= target
    return "pass" if ok else "FAIL"


# ------------------------------------------------------------------------------------------------
# Headline table
# ------------------------------------------------------------------------------------------------


def headline(main, scaling, memory):
    r = by_name(main)
    rows = []  # (what, measured text, target text, verdict)

    def frac_row(what, name, key):
        res = r.get(name)
        v = res.counter("frac_sgemm") if res else None
        detail = f" ({fmt(res.counter('GFLOPS'))} GFLOPS, {fmt(res.time_ms)} ms)" if res else ""
        rows.append((what, fmt(v) + detail, f">= {TARGETS[key]}", verdict(v, TARGETS[key], ">=")))

    frac_row("Self-attention prefill, causal, T=4096 d=128 H=8: frac_sgemm",
             "BM_SelfAttention_prefill/T:4096/d:128/H:8", "self_frac_d128")
    frac_row("Self-attention prefill, causal, T=4096 d=64 H=8: frac_sgemm",
             "BM_SelfAttention_prefill/T:4096/d:64/H:8", "self_frac_d64")
    frac_row("OVQ prefill T=32768 N=2048 L=128 d=128 H=8: frac_sgemm",
             "BM_OVQ_prefill/T:32768/N:2048/L:128/d:128/H:8", "ovq_frac")

    # Time per token, T=65536 over T=16384 (same heads), dictionary full: the verdict comes from
    # BM_OVQ_prefill_full (both start from a state at capacity, so the FLOPs per token match);
    # the empty-start cases follow as information (there the dictionary is still growing).
    # The most heads measured at both T (the full suite has H=8, the quick one H=2).
    def prefill_pair(family):
        for h in (8, 2):
            long_, short = (r.get(f"{family}/T:{t}/N:2048/L:128/d:128/H:{h}")
                            for t in (65536, 16384))
            if long_ and short:
                return long_, short
        return None, None

    def per_token_detail(long_, short):
        ratio = (long_.time_ms / 65536) / (short.time_ms / 16384)
        fr = (long_.flops() / 65536) / (short.flops() / 16384)
        detail = (f" ({fmt(long_.time_ms / 65536 * 1e3)} vs {fmt(short.time_ms / 16384 * 1e3)} "
                  f"us/token; FLOPs/token ratio {fmt(fr)}; dictionary "
                  f"{fmt_rows(long_)} and {fmt_rows(short)} of 2048 rows)")
        return ratio, detail

    limit = TARGETS["ovq_linear_in_t"]
    long_, short = prefill_pair("BM_OVQ_prefill_full")
    v, detail = None, ""
    if long_ and short:
        v, detail = per_token_detail(long_, short)
    rows.append(("OVQ prefill time per token at capacity, T=65536 vs T=16384 (dictionary full, "
                 "N=2048 L=128 d=128%s)" % (f" H={long_.hq}" if long_ else ""),
                 fmt(v) + detail, f"<= {limit}", verdict(v, limit, "<=")))
    long_, short = prefill_pair("BM_OVQ_prefill")
    if long_ and short:
        v, detail = per_token_detail(long_, short)
        rows.append((f"(information) the same from empty states, H={long_.hq}: the dictionary "
                     "still grows between them", fmt(v) + detail, "", "info"))

    # OVQ vs self-attention at T=32768, per head; the same heads when both ran them
    # (self-attention runs fewer heads at long T).
    def at_32k(family, extra):
        return {x.hq: x for x in r.values() if x.family == family and x.args.get("T") == 32768
                and x.args.get("d") == 128 and "H" in x.args
                and all(x.args.get(k) == v for k, v in extra.items())}
    selfs = at_32k("BM_SelfAttention_prefill", {})
    ovqs = at_32k("BM_OVQ_prefill", {"N": 2048, "L": 128})
    common = sorted(set(selfs) & set(ovqs))
    s = selfs[common[-1]] if common else (selfs[max(selfs)] if selfs else None)
    ovq = ovqs[common[-1]] if common else (ovqs[max(ovqs)] if ovqs else None)
    v, detail = None, ""
    if ovq and s:
        v = (s.time_ms / s.hq) / (ovq.time_ms / ovq.hq)
        detail = (f" (self H={s.hq}: {fmt(s.time_ms / s.hq)} ms/head; "
                  f"OVQ H={ovq.hq}: {fmt(ovq.time_ms / ovq.hq)} ms/head)")
    rows.append(("OVQ prefill vs our self-attention at T=32768, d=128: speedup per head",
                 fmt(v) + detail, f">= {TARGETS['ovq_vs_self_prefill']}",
                 verdict(v, TARGETS["ovq_vs_self_prefill"], ">=")))

    lin = [r.get(f"BM_LinearAttention_prefill/T:2048/L:{c}/d:128/H:8") for c in (32, 64, 128)]
    lin = [x for x in lin if x]
    v, detail = None, ""
    if lin:
        best = max(lin, key=lambda x: x.counter("frac_sgemm"))
        v = best.counter("frac_sgemm")
        detail = " (best chunk L=%d; %s)" % (best.args["L"], ", ".join(
            f"L={x.args['L']}: {fmt(x.counter('frac_sgemm'))}" for x in lin))
    rows.append(("Linear attention chunked prefill T=2048 d=128 H=8: frac_sgemm",
                 fmt(v) + detail, f">= {TARGETS['linear_frac']}",
                 verdict(v, TARGETS["linear_frac"], ">=")))

    # A time ratio of two cases: how the report got their times, when both came from a paired
    # run (their repetitions interleaved in one process).
    def interleaved(a, b):
        if not (a.paired and b.paired):
            return ""
        return f"; best of {min(a.repetitions, b.repetitions)} interleaved repetitions each"

    for ctx, label in ((4096, "4096"), (65536, "64k")):
        for elem in ("", "/elem:bf16", "/elem:bf16/arch:amx"):
            g, h = (r.get(f"BM_SelfAttention_decode/ctx:{ctx}/d:128/{heads}{elem}")
                    for heads in ("Hq:32/Hkv:8", "H:8"))
            if elem and not (g and h):
                continue
            v, detail = None, ""
            if g and h:
                v = g.time_ms / h.time_ms
                detail = f" ({fmt(g.time_ms)} vs {fmt(h.time_ms)} ms/step{interleaved(g, h)})"
            what = (f"Decode step, self-attention, Hq/Hkv=32/8 vs 8/8 at context {label}"
                    f"{', bf16 cache' if elem else ''}"
                    f"{' on AMX tiles' if 'arch:amx' in elem else ''}: time ratio")
            rows.append((what, fmt(v) + detail, f"<= {TARGETS['gqa_decode']}",
                         verdict(v, TARGETS["gqa_decode"], "<=")))

    # A sliding window reads W - 1 rows and drops one per step: it should cost what a full cache
    # of that many rows costs, however long the stream before it.
    w = r.get("BM_SelfAttention_decode_window/ctx:65536/window:4096/d:128/H:8")
    h = r.get("BM_SelfAttention_decode/ctx:4096/d:128/H:8")
    v, detail = None, ""
    if w and h:
        v = w.time_ms / h.time_ms
        detail = f" ({fmt(w.time_ms)} vs {fmt(h.time_ms)} ms/step{interleaved(w, h)})"
    rows.append(("Decode step, self-attention d=128 H=8, sliding window 4096 after 64k tokens vs "
                 "a full cache of 4096 rows: time ratio", fmt(v) + detail,
                 f"<= {TARGETS['window_decode']}", verdict(v, TARGETS["window_decode"], "<=")))

    # Decode at capacity: the verdict comes from BM_OVQ_decode_full (dictionary full at both
    # contexts); the empty-start cases follow as information.
    def decode_ratio(family):
        a, b = (r.get(f"{family}/ctx:{c}/N:2048/d:128/H:8") for c in (65536, 4096))
        if not (a and b):
            return None, ""
        return a.time_ms / b.time_ms, (f" ({fmt(a.time_ms)} vs {fmt(b.time_ms)} ms/step; "
                                       f"dictionary {fmt_rows(a)} and {fmt_rows(b)} of 2048 rows"
                                       f"{interleaved(a, b)})")

    v, detail = decode_ratio("BM_OVQ_decode_full")
    rows.append(("Decode step, OVQ at capacity N=2048 d=128 H=8, context 64k vs 4k "
                 "(dictionary full): time ratio",
                 fmt(v) + detail, f"<= {TARGETS['ovq_decode_flat']}",
                 verdict(v, TARGETS["ovq_decode_flat"], "<=")))
    v, detail = decode_ratio("BM_OVQ_decode")
    if v is not None:
        rows.append(("(information) the same with contexts written from empty states",
                     fmt(v) + detail, "", "info"))

    # OVQ at capacity when measured (the quick suite runs only that one at 64k), else the
    # context written from an empty state (1986 of 2048 rows at 64k).
    s = r.get("BM_SelfAttention_decode/ctx:65536/d:128/H:8")
    o = (r.get("BM_OVQ_decode_full/ctx:65536/N:2048/d:128/H:8")
         or r.get("BM_OVQ_decode/ctx:65536/N:2048/d:128/H:8"))
    v, detail = None, ""
    if s and o:
        v = s.time_ms / o.time_ms
        detail = (f" ({fmt(s.time_ms)} vs {fmt(o.time_ms)} ms/step; OVQ `{short_name(o.name)}`, "
                  f"dictionary {fmt_rows(o)} rows)")
    rows.append(("Decode step at context 64k, OVQ (N=2048) vs self-attention, d=128 H=8: speedup",
                 fmt(v) + detail, f">= {TARGETS['ovq_vs_self_decode']}",
                 verdict(v, TARGETS["ovq_vs_self_decode"], ">=")))

    # Thread scaling against the machine's own: each case's speedup over Eigen's sgemm speedup
    # in the processes that case ran in.
    pairs = [p for p in thread_pairs(scaling) if p.phase == "prefill"]
    v, detail = None, ""
    relative = [(p, p.speedup / p.sgemm_same) for p in pairs if p.sgemm_same]
    if relative:
        lowest, v = min(relative, key=lambda x: x[1])
        reps = lowest.repetitions
        detail = (" (min over cases of the speedup, best time on 1 thread / best on "
                  f"{lowest.threads}, over sgemm's in the same processes; {lowest.rounds} rounds "
                  f"of {reps} repetition{'' if reps == 1 else 's'}; "
                  + ", ".join(f"{short_name(p.name)}: {fmt(p.speedup)} / {fmt(p.sgemm_same)}"
                              for p, _ in relative) + ")")
    threads = pairs[0].threads if pairs else thread_count(main)
    rows.append((f"Prefill, {threads} threads vs 1 thread: speedup over Eigen's sgemm speedup",
                 fmt(v) + detail, f">= {TARGETS['threads']}", verdict(v, TARGETS["threads"], ">=")))

    if memory and memory.get("checkpoints"):
        cps = {c["tokens"]: c for c in memory["checkpoints"]}
        first, last = memory["checkpoints"][0], memory["checkpoints"][-1]
        same = first["state_bytes"] == last["state_bytes"]
        rows.append((f"OVQ state bytes after {first['tokens'] // 1024}k and after "
                     f"{last['tokens'] // 1024}k streamed tokens",
                     f"{first['state_bytes']} B and {last['state_bytes']} B "
                     f"(dictionary {first['dictionary_max']} and {last['dictionary_max']} of "
                     f"{memory['config']['capacity']} rows)",
                     "equal", "pass" if same else "FAIL"))
        hwm = ", ".join(f"{t // 1024}k: {fmt_bytes(c['vm_hwm_kib'] * 1024)}"
                        for t, c in sorted(cps.items()))
        growth = memory.get("hwm_growth_kib", 0)
        tol = memory["config"].get("tolerance_kib", 0)
        rows.append(("Peak resident memory (VmHWM) streaming OVQ, growth from the first to the "
                     "last checkpoint", f"{growth} KiB ({hwm})", f"<= {tol} KiB",
                     "pass" if memory.get("pass") and growth <= tol else "FAIL"))
    else:
        rows.append(("OVQ state bytes after 16k and 256k streamed tokens", "n/a", "equal",
                     "not measured"))
    return rows


def limits_rows(main, peers):
    """The goals measured against the machine's own ceilings, 16-bit storage and PyTorch."""
    r = by_name(main)
    rows = []

    def row(what, v, detail, key, kind):
        rows.append((what, fmt(v) + detail, f"{kind} {TARGETS[key]}", verdict(v, TARGETS[key], kind)))

    def counter_row(what, name, counter, key):
        res = r.get(name)
        v = res.counter(counter) if res and counter in res.raw else None
        detail = ""
        if res:
            rate = (f"{fmt(res.counter('read_GBps'))} GB/s" if "read_GBps" in res.raw
                    else f"{fmt(res.counter('GFLOPS'))} GFLOPS")
            detail = f" ({fmt(res.time_ms)} ms, {rate})"
        row(what, v, detail, key, ">=")

    def speedup_row(what, slow, fast, key):
        v, detail = None, ""
        if slow and fast:
            v = slow[1] / fast[1]
            detail = f" ({slow[0]} {fmt(slow[1])} ms, {fast[0]} {fmt(fast[1])} ms)"
        row(what, v, detail, key, ">=")

    def ours(name, label="ovq"):
        res = r.get(name)
        return (label, res.time_ms) if res else None

    def torch(name):
        ms = peers.get(name)
        return ("PyTorch", ms) if ms is not None else None

    prefill = "BM_SelfAttention_prefill/T:4096/d:128/H:8"
    counter_row("fp32 causal prefill T=4096 d=128 H=8: frac_peak (fp32 FMA peak)", prefill,
                "frac_peak", "self_frac_peak")
    speedup_row("fp32 causal prefill T=4096 d=128 H=8: PyTorch SDPA time / ours",
                torch(prefill), ours(prefill), "self_vs_torch")
    speedup_row("bf16 causal prefill, same shape: speedup over our fp32",
                ours(prefill, "fp32"), ours(prefill + "/elem:bf16", "bf16"),
                "bf16_vs_fp32_prefill")
    speedup_row("bf16 causal prefill, same shape: PyTorch SDPA bf16 time / ours",
                torch(prefill + "/elem:bf16"), ours(prefill + "/elem:bf16"), "bf16_vs_torch")
    amx = "/elem:bf16/arch:amx"  # arch::amx where it is not the native kernels
    if r.get(prefill + amx):
        speedup_row("bf16 causal prefill on AMX tiles (arch::amx): speedup over our fp32",
                    ours(prefill, "fp32"), ours(prefill + amx, "amx"), "bf16_vs_fp32_prefill")
        speedup_row("bf16 causal prefill on AMX tiles: PyTorch SDPA bf16 time / ours",
                    torch(prefill + "/elem:bf16"), ours(prefill + amx), "bf16_vs_torch")
    decode = "BM_SelfAttention_decode/ctx:65536/d:128/H:8"
    counter_row("Decode step, self-attention, context 64k, H=8, fp32: frac_bandwidth", decode,
                "frac_bandwidth", "decode_frac_bandwidth")
    caches = [("/elem:bf16", "bf16"), ("/elem:fp16", "fp16")]
    if r.get(decode + amx):
        caches.append((amx, "bf16 (AMX tiles)"))
    for suffix, elem in caches:
        speedup_row(f"The same with a {elem} cache: speedup over fp32", ours(decode, "fp32"),
                    ours(decode + suffix, elem), "half_vs_fp32_decode")
        counter_row(f"The same with a {elem} cache: frac_bandwidth on its 16-bit bytes",
                    decode + suffix, "frac_bandwidth", "decode_frac_bandwidth")
    ovq_decode = "BM_OVQ_decode_full/ctx:65536/N:2048/d:128/H:8"
    speedup_row("OVQ decode at capacity, context 64k N=2048 d=128 H=8: bf16 dictionary's "
                "speedup over fp32", ours(ovq_decode, "fp32"),
                ours(ovq_decode + "/elem:bf16", "bf16"), "ovq_bf16_decode")
    counter_row("OVQ prefill T=32768 N=2048 L=128 d=128 H=8: frac_peak",
                "BM_OVQ_prefill/T:32768/N:2048/L:128/d:128/H:8", "frac_peak", "ovq_frac_peak")
    return rows


def ceilings(main):
    """{binary: {family: best rate}} of the BM_Peak_* cases (GFLOPS, GB/s for the read)."""
    out = {}
    for (binary, _), res in main.items():
        if res.error or not res.family.startswith("BM_Peak_"):
            continue
        rate = res.counter("GBps" if res.family == "BM_Peak_read" else "GFLOPS")
        if isinstance(rate, (int, float)) and not math.isnan(rate):
            fam = out.setdefault(binary, {})
            fam[res.family] = max(fam.get(res.family, 0.0), rate)
    return out


def load_peers(directory, problems):
    """({ovq case name: best PyTorch time in ms}, context) from DIR/peers_torch.json."""
    path = os.path.join(directory, "peers_torch.json")
    if not os.path.exists(path):
        return {}, None
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        problems.append(f"peers_torch.json: {e}")
        return {}, None
    best = {}
    for b in data.get("benchmarks", []):
        best[b["name"]] = min(best.get(b["name"], math.inf), b["time_ms"])
    return best, data.get("context", {})


def load_python(directory, problems):
    """DIR/python.json (scripts/lib/bench_python.py), or None."""
    path = os.path.join(directory, "python.json")
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        problems.append(f"python.json: {e}")
        return None


PYTHON_OVERHEAD_US = 10.0  # goal: per-call overhead of ovq.torch on a decode step


def python_rows(py):
    """(what, measured, target, verdict) rows of the Python row's goals."""
    if not py:
        return []
    rows = []
    for r in py.get("overhead", []):
        if r["path"].startswith("C++"):
            continue
        over = r["overhead_us"]
        rows.append((f"Python: per-call overhead, {r['path']}", f"{over:.2f} us",
                     f"<= {PYTHON_OVERHEAD_US:g} us", verdict(over, PYTHON_OVERHEAD_US, "<=")))
    for r in py.get("sdpa", []):
        ratio = r["torch_over_ovq"]
        rows.append((f"Python: {r['case']}, SDPA / ovq", f"{ratio:.2f}x", ">= 1x",
                     verdict(ratio, 1.0, ">=")))
    return rows


def python_table(py):
    lines = ["| path | us per call | overhead over the C++ loop (us) |", "|---|---:|---:|"]
    for r in py.get("overhead", []):
        lines.append(f"| {r['path']} | {r['us_per_call']:.2f} | {r['overhead_us']:.2f} |")
    lines += ["", "| case | ovq (ms) | SDPA (ms) | SDPA / ovq |", "|---|---:|---:|---:|"]
    for r in py.get("sdpa", []):
        lines.append(f"| {r['case']} | {r['ovq_ms']:.3f} | {r['torch_ms']:.3f} | "
                     f"{r['torch_over_ovq']:.2f} |")
    return lines


def peers_table(main, peers):
    r = by_name(main)
    lines = ["| case | ovq (ms) | PyTorch SDPA (ms) | PyTorch / ovq |", "|---|---:|---:|---:|"]
    for name, ms in sorted(peers.items()):
        res = r.get(name)
        mine = res.time_ms if res else None
        ratio = ms / mine if mine else None
        lines.append(f"| `{short_name(name)}` | {fmt(mine)} | {fmt(ms)} | {fmt(ratio)} |")
    return lines


def fmt_rows(res):
    """The dictionary rows an OVQ case reports (counter n)."""
    n = res.counter("n", None)
    return str(int(n)) if isinstance(n, (int, float)) and not math.isnan(n) else "?"


def short_name(name):
    return name.replace("BM_", "").replace("_prefill", "")


def thread_count(main):
    for r in main.values():
        t = r.counter("threads", None)
        if t:
            return int(t)
    return "N"


class ScalingPair:
    """One case of the thread-scaling rounds: the best time on 1 thread and on `threads`.

    one, many: {round: [Result, one per repetition]} on 1 thread and on `threads`.
    """

    def __init__(self, name, phase, threads, one, many):
        self.name, self.phase, self.threads = name, phase, threads
        rounds = sorted(set(one) & set(many))
        self.round_keys = rounds  # (binary, round) of every process both counts ran in
        self.rounds = len(rounds)
        self.repetitions = min(len(one[k]) for k in rounds) if rounds else 0
        self.best_one = min(r.time_ms for k in rounds for r in one[k])
        self.best_many = min(r.time_ms for k in rounds for r in many[k])
        self.speedup = self.best_one / self.best_many
        # Both thread counts of a round ran together, so each round has its own ratio too.
        self.per_round = [min(r.time_ms for r in one[k]) / min(r.time_ms for r in many[k])
                          for k in rounds]
        # Runs before --thread-counts had one process per thread count (no nthreads argument).
        self.shared_process = any(r.nthreads is not None for k in rounds for r in one[k])


def thread_pairs(scaling):
    """A ScalingPair per case measured on 1 thread and on more (BM_Peak_sgemm's phase: sgemm).

    Each case's `sgemm_same` is BM_Peak_sgemm's speedup over the processes that case ran in
    (None where sgemm did not run there): what the machine's own GEMM gave alongside it."""
    pairs = []
    for name, by_threads in sorted(scaling.items()):
        many = [t for t in by_threads if t > 1]
        if 1 not in by_threads or not many:
            continue
        t = max(many)
        if not set(by_threads[1]) & set(by_threads[t]):
            continue
        phase = next(iter(by_threads[1].values()))[0].phase
        pairs.append(ScalingPair(name, phase, t, by_threads[1], by_threads[t]))
    sgemm = scaling.get("BM_Peak_sgemm", {})
    for p in pairs:
        keys = set(p.round_keys)
        one = {k: v for k, v in sgemm.get(1, {}).items() if k in keys}
        many = {k: v for k, v in sgemm.get(p.threads, {}).items() if k in keys}
        p.sgemm_same = (ScalingPair("BM_Peak_sgemm", "sgemm", p.threads, one, many).speedup
                        if p.phase != "sgemm" and set(one) & set(many) else None)
    return pairs


# ------------------------------------------------------------------------------------------------
# Plots
# ------------------------------------------------------------------------------------------------


def curve(results, family, extra, d, key):
    """Points (x, result) of a family at head dim d, Hq = Hkv; the most heads at each x."""
    best = {}
    for r in results.values():
        if r.family != family or r.args.get("d") != d or "H" not in r.args or "elem" in r.args:
            continue
        if any(r.args.get(k) != v for k, v in extra.items()):
            continue
        x = r.args[key]
        if x not in best or r.hq > best[x].hq:
            best[x] = r
    return sorted(best.items(), key=lambda p: p[0])


def plot(directory, main):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001 - any import failure means no plots
        return f"plots not drawn: matplotlib is not available ({e.__class__.__name__}: {e})"
    r = by_name(main)
    threads = thread_count(main)
    written = []

    fig, ax = plt.subplots(figsize=(7, 5))
    for label, prefix, extra in MIXERS:
        for d, style in ((128, "-o"), (64, "--s")):
            pts = curve(r, prefix + "_prefill", extra, d, "T")
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1].time_ms / p[1].hq for p in pts], style,
                    label=f"{label}, d={d}", markersize=4)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens T")
    ax.set_ylabel("wall time / H (ms)")
    ax.set_title(f"Prefill, fp32, {threads} threads (H = 8; fewer heads at the longest T)",
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(directory, "prefill.png"), dpi=110)
    plt.close(fig)
    written.append("prefill.png")

    fig, ax = plt.subplots(figsize=(7, 5))
    decode_curves = [("self-attention H=8", "BM_SelfAttention_decode", {"H": 8})]
    decode_curves.append(("self-attention Hq/Hkv=32/8", "BM_SelfAttention_decode",
                          {"Hq": 32, "Hkv": 8}))
    decode_curves.append(("linear", "BM_LinearAttention_decode", {"H": 8}))
    decode_curves.append(("VQ S=2048", "BM_VQ_decode", {"S": 2048, "H": 8}))
    for n in (512, 2048, 8192):
        decode_curves.append((f"OVQ N={n}", "BM_OVQ_decode", {"N": n, "H": 8}))
    decode_curves.append(("OVQ N=2048, dictionary full", "BM_OVQ_decode_full", {"N": 2048, "H": 8}))
    for label, family, extra in decode_curves:
        pts = sorted(((x.args["ctx"], x) for x in r.values() if x.family == family
                      and x.args.get("d") == 128 and "elem" not in x.args
                      and all(x.args.get(k) == v for k, v in extra.items())),
                     key=lambda p: p[0])
        if len(extra) == 1 and "H" in extra:
            pts = [p for p in pts if "Hq" not in p[1].args]
        if not pts:
            continue
        style = "--o" if "Hq" in extra else (":^" if family.endswith("_full") else "-o")
        ax.plot([p[0] for p in pts], [p[1].time_ms for p in pts], style, label=label,
                markersize=4)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode step, all heads (ms)")
    ax.set_title(f"Decode latency, d=128, fp32, {threads} threads")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(directory, "decode.png"), dpi=110)
    plt.close(fig)
    written.append("decode.png")
    return None


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------


def results_table(results):
    lines = ["| benchmark | time (ms) | iterations | GFLOPS | frac_sgemm | frac_peak | GB/s | "
             "frac_bandwidth | state | tokens/s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (_, name), r in results.items():
        if r.error:
            lines.append(f"| `{name}` | error: {r.error_message} | | | | | | | | |")
            continue
        state = r.counter("bytes_state", None)
        def opt(key):
            return fmt(r.counter(key)) if key in r.raw else ""

        rate = opt("GBps") if r.family == "BM_Peak_read" else opt("read_GBps")
        lines.append("| `%s` | %s | %d | %s | %s | %s | %s | %s | %s | %s |" % (
            name, fmt(r.time_ms), r.iterations, opt("GFLOPS"), opt("frac_sgemm"),
            opt("frac_peak"), rate, opt("frac_bandwidth"),
            fmt_bytes(state) if state is not None else "",
            fmt(r.counter("tokens_per_s")) if "tokens_per_s" in r.raw else ""))
    return lines


def cpu_model():
    """The processor's name from /proc/cpuinfo (the report is written where the runs ran)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown processor"


def run_facts(args, ctx, threads):
    """The lines that say where and how a run was made: commit, machine, ISA, threads."""
    return [f"- commit: {args.commit or 'unknown'}; ovq {ctx.get('ovq_version', '?')}; "
            f"{threads} threads (OpenMP: {ctx.get('ovq_openmp', '?')}, "
            f"kernels' ISA: {ctx.get('ovq_arch', '?')}, Eigen SIMD: "
            f"{ctx.get('eigen_simd', '?')})",
            f"- machine: {cpu_model()}, {ctx.get('num_cpus', '?')} CPUs at "
            f"{ctx.get('mhz_per_cpu', '?')} MHz, {ctx.get('host_name', '?')}; "
            f"run started {ctx.get('date', '?')}; load average at start "
            f"{', '.join(fmt(x) for x in ctx.get('load_avg', [])) or '?'}"]


def ceilings_line(main):
    best = {}
    for fam in ceilings(main).values():
        for k, v in fam.items():
            best[k] = max(best.get(k, 0.0), v)
    parts = [f"fp32 FMA {fmt(best['BM_Peak_fma'])} GFLOPS" if "BM_Peak_fma" in best else None,
             f"bf16 dot products {fmt(best['BM_Peak_bf16dot'])} GFLOPS"
             if "BM_Peak_bf16dot" in best else None,
             f"memory read {fmt(best['BM_Peak_read'])} GB/s" if "BM_Peak_read" in best else None,
             f"Eigen sgemm {fmt(best[SGEMM_FAMILY])} GFLOPS" if SGEMM_FAMILY in best else None]
    parts = [p for p in parts if p]
    return ("- machine's ceilings, best over the run (each case divides by those of its own "
            "process): " + "; ".join(parts)) if parts else None


def limits_table(main, peers):
    lines = ["| case | measured | goal | |", "|---|---|---|---|"]
    for what, measured, target, v in limits_rows(main, peers):
        lines.append(f"| {what} | {measured} | {target} | {v} |")
    return lines


def write_summary(directory, args, main, scaling, contexts, memory, peers, peer_context,
                  python=None):
    """DIR/summary.md: the facts of the run and its two goal tables, for bench/README.md."""
    ctx = next(iter(contexts.values()), {})
    lines = [f"Written by `scripts/bench --{args.mode}{' --peers' if peers else ''}`."]
    lines += run_facts(args, ctx, thread_count(main))
    c = ceilings_line(main)
    if c:
        lines.append(c)
    if peer_context:
        lines.append(f"- PyTorch {peer_context.get('torch_version', '?')}, CPU capability "
                     f"{peer_context.get('cpu_capability', '?')}, "
                     f"{peer_context.get('threads', '?')} threads")
    lines += ["", "| case | measured | target | |", "|---|---|---|---|"]
    rows = headline(main, scaling, memory) + limits_rows(main, peers) + python_rows(python)
    for what, measured, target, v in rows:
        lines.append(f"| {what} | {measured} | {target} | {v} |")
    lines.append("")
    with open(os.path.join(directory, "summary.md"), "w") as f:
        f.write("\n".join(lines))


README_BEGIN = "<!-- results: written by scripts/bench --update-readme -->"
README_END = "<!-- end of results -->"


def update_readme(path, directory):
    """Replaces the results block of bench/README.md with DIR/summary.md."""
    with open(path) as f:
        text = f.read()
    begin, end = text.find(README_BEGIN), text.find(README_END)
    if begin < 0 or end < begin:
        raise SystemExit(f"plot_bench.py: {path} has no results block ({README_BEGIN} ... "
                         f"{README_END})")
    with open(os.path.join(directory, "summary.md")) as f:
        summary = f.read()
    text = text[:begin + len(README_BEGIN)] + "\n" + summary.strip() + "\n" + text[end:]
    with open(path, "w") as f:
        f.write(text)


def write_report(directory, args, main, scaling, contexts, memory, problems, plot_note,
                 peers=None, peer_context=None, python=None):
    peers = peers or {}
    ctx = next(iter(contexts.values()), {})
    threads = thread_count(main)
    lines = [f"# ovq benchmarks ({args.mode} suite)", ""]
    lines += run_facts(args, ctx, threads)
    c = ceilings_line(main)
    if c:
        lines.append(c)
    sg = [(b, r) for (b, _), r in main.items() if r.family == SGEMM_FAMILY and not r.error]
    if sg:
        # Per binary: the first measurement, the one after the cases ("at end"), and the
        # reference frac_sgemm divides by (rebase_frac_sgemm: their best, or a case's own
        # reference when a sizing call, not in the JSON, was faster).
        by_binary, reference = {}, {}
        for b, r in sg:
            by_binary.setdefault(b, []).append(
                f"{fmt(r.counter('GFLOPS'))}" + (" at end" if r.args.get("at") == "end" else ""))
        for (b, _), r in main.items():
            if "sgemm_GFLOPS" in r.raw and not r.error and not r.paired:
                reference[b] = r.counter("sgemm_GFLOPS")
        lines.append("- sgemm reference (BM_Peak_sgemm, 2048^3, Eigen, per binary, before and "
                     "after its cases, then the rate frac_sgemm divides by): " + ", ".join(
                         f"{b}: {' / '.join(v)}"
                         + (f"; {fmt(reference[b])}" if b in reference else "") + " GFLOPS"
                         for b, v in by_binary.items()))
        # On an idle machine the main thread computes the whole time; a share well below 1 means
        # other processes held the cores, and every number here is slower and noisier.
        share = [r.raw.get("cpu_time", 0) / r.raw["real_time"] for _, r in sg
                 if r.raw.get("real_time")]
        if share:
            lines.append("- CPU share (main-thread CPU time / wall time in BM_Peak_sgemm; about "
                         "1 on an idle machine): " + ", ".join(fmt(x, 2) for x in share)
                         + (" -- **the machine was busy: times are inflated and noisy**"
                            if min(share) < 0.8 else ""))
    reps = max((r.repetitions for r in main.values() if not r.paired), default=1)
    if reps > 1:
        lines.append(f"- repetitions: every case ran {reps} times in a row; each number below is "
                     "from its fastest repetition (the sgemm reference too)")
    paired = sorted(short_name(r.name) for r in main.values() if r.paired)
    if paired:
        n = max(r.repetitions for r in main.values() if r.paired)
        lines.append(f"- paired decode runs: {', '.join(f'`{p}`' for p in paired)} ran "
                     f"{n} times each in a process per binary, their repetitions interleaved at "
                     "random, so that the two cases of a decode time ratio see the same load; "
                     "each keeps its fastest")
    if args.run_seconds is not None:
        lines.append(f"- wall time: runs {args.run_seconds} s, build {args.build_seconds} s")
    lines.append("")
    lines.append("GFLOPS counts the FLOPs the mathematics needs: the causal half of self-attention "
                 "and of linear attention's chunk products; for OVQ the reads, the assignment "
                 "and the seeding, with the dictionary size given by the growth schedule "
                 "(fixed at N for the `_full` cases, which start from a full dictionary). "
                 "frac_sgemm divides by the best sgemm rate measured in the same process, "
                 "before and after its cases. Names "
                 "below drop Google Benchmark's `/real_time` suffix. Time is wall time.")
    lines.append("")
    lines.append("## Headline")
    lines.append("")
    lines.append("| case | measured | target | |")
    lines.append("|---|---|---|---|")
    for what, measured, target, v in headline(main, scaling, memory):
        lines.append(f"| {what} | {measured} | {target} | {v} |")
    lines.append("")
    lines.append("Targets are this project's bar for the fp32 kernels on a 2-core machine; they "
                 "live in `scripts/lib/plot_bench.py` (TARGETS).")
    lines.append("")
    lines.append("## Against the machine's limits, 16-bit storage and PyTorch")
    lines.append("")
    lines.append("frac_peak divides GFLOPS by the fp32 FMA peak (BM_Peak_fma), frac_bandwidth "
                 "the bytes a decode step must read by the memory read rate (BM_Peak_read), both "
                 "measured on the same threads in the same process, before and after its cases.")
    lines.append("")
    lines += limits_table(main, peers)
    lines.append("")
    lines.append("## PyTorch side by side")
    lines.append("")
    if peers:
        pc = peer_context or {}
        lines.append(f"`torch.nn.functional.scaled_dot_product_attention`, PyTorch "
                     f"{pc.get('torch_version', '?')} (CPU capability "
                     f"{pc.get('cpu_capability', '?')}), {pc.get('threads', '?')} threads, "
                     "the same shapes and dtypes, in the same run (scripts/lib/bench_peers.py); "
                     "best of its repetitions.")
        lines.append("")
        lines += peers_table(main, peers)
    else:
        lines.append("not measured (scripts/bench --peers)")
    lines.append("")
    lines.append("## From Python")
    lines.append("")
    if python:
        pc = python.get("context", {})
        lines.append(f"ovq.torch and PyTorch {pc.get('torch', '?')} in one process, "
                     f"{pc.get('threads', '?')} threads (scripts/lib/bench_python.py).")
        lines.append("")
        lines += python_table(python)
        lines.append("")
        lines += ["| goal | measured | target | |", "|---|---|---|---|"]
        for what, measured, target, v in python_rows(python):
            lines.append(f"| {what} | {measured} | {target} | {v} |")
    else:
        lines.append("not measured (scripts/bench --peers)")
    lines.append("")
    if plot_note:
        lines.append(f"_{plot_note}_")
    else:
        lines.append("![prefill](prefill.png)")
        lines.append("")
        lines.append("![decode](decode.png)")
    lines.append("")
    lines.append("## Thread scaling (prefill)")
    lines.append("")
    pairs = thread_pairs(scaling)
    if pairs and not pairs[0].shared_process:
        lines.append("Each round runs the cases on 1 thread and then on the main runs' threads, "
                     "back to back; the speedup is the best 1-thread time over the best "
                     "multi-thread time. `BM_Peak_sgemm` (Eigen's GEMM) is the machine's own "
                     "reference: what two threads of this machine gave at that time.")
    elif pairs:
        lines.append("Each round runs every binary once, with its cases on 1 thread and on the "
                     "main runs' threads (`--thread-counts`), their repetitions interleaved at "
                     "random; the speedup is the best 1-thread time over the best multi-thread "
                     "time, and each round's own ratio is listed. `BM_Peak_sgemm` (Eigen's "
                     "GEMM) is the machine's own reference: what two threads of this machine "
                     "gave at that time, over all rounds in its own row and, per case, over the "
                     "processes that case ran in.")
    if pairs:
        lines.append("")
        lines.append("| benchmark | threads | best (ms) | best on 1 thread (ms) | speedup | "
                     "sgemm, same processes | per round |")
        lines.append("|---|---:|---:|---:|---:|---:|---|")
        for p in pairs:
            same = "" if p.sgemm_same is None else fmt(p.sgemm_same)
            lines.append(f"| `{p.name}` | {p.threads} | {fmt(p.best_many)} | {fmt(p.best_one)} | "
                         f"{fmt(p.speedup)} | {same} | "
                         f"{', '.join(fmt(x) for x in p.per_round)} |")
    else:
        lines.append("not measured")
    lines.append("")
    lines.append("## Streaming memory (OVQ)")
    lines.append("")
    if memory:
        c = memory.get("config", {})
        lines.append(f"{c.get('tokens')} tokens through MultiHead<OvqAttention> (B=1, "
                     f"H={c.get('heads')}, d={c.get('d')}, N={c.get('capacity')}, "
                     f"L={c.get('chunk')}), {c.get('piece')} tokens per call, inputs generated "
                     f"on the fly. Verdict: {memory.get('verdict')}.")
        lines.append("")
        lines.append("| tokens | VmHWM | VmRSS | state bytes | dictionary rows | elapsed (s) |")
        lines.append("|---:|---:|---:|---:|---:|---:|")
        for cp in memory.get("checkpoints", []):
            lines.append(f"| {cp['tokens']} | {fmt_bytes(cp['vm_hwm_kib'] * 1024)} | "
                         f"{fmt_bytes(cp['vm_rss_kib'] * 1024)} | {cp['state_bytes']} | "
                         f"{cp['dictionary_max']} | {fmt(cp['seconds'])} |")
    else:
        lines.append("not measured")
    lines.append("")
    lines.append("## All results")
    for binary in sorted({b for b, _ in main}):
        lines.append("")
        lines.append(f"### {binary}")
        lines.append("")
        lines += results_table({k: v for k, v in main.items() if k[0] == binary})
    if args.failed.strip():
        problems.append(f"runs that exited non-zero: {args.failed.strip()} (their JSON may be "
                        "partial or missing)")
    if problems:
        lines.append("")
        lines.append("## Problems")
        lines.append("")
        lines += [f"- {p}" for p in problems]
    lines.append("")
    with open(os.path.join(directory, "report.md"), "w") as f:
        f.write("\n".join(lines))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("directory")
    ap.add_argument("--mode", default="quick")
    ap.add_argument("--run-seconds", type=int)
    ap.add_argument("--build-seconds", type=int, default=0)
    ap.add_argument("--commit", default="")
    ap.add_argument("--failed", default="", help="runs that exited non-zero")
    ap.add_argument("--readme", help="write the summary into this file's results block too")
    args = ap.parse_args()
    main_results, scaling, contexts, memory, problems = load(args.directory)
    peers, peer_context = load_peers(args.directory, problems)
    python = load_python(args.directory, problems)
    if not main_results:
        problems.append("no benchmark results found")
    plot_note = (plot(args.directory, main_results) if main_results
                 else "plots not drawn: no results")
    write_report(args.directory, args, main_results, scaling, contexts, memory, problems,
                 plot_note, peers, peer_context, python)
    write_summary(args.directory, args, main_results, scaling, contexts, memory, peers,
                  peer_context, python)
    if args.readme:
        update_readme(args.readme, args.directory)
    print(f"report: {os.path.join(args.directory, 'report.md')}"
          + (f" ({plot_note})" if plot_note else " with prefill.png and decode.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
