#!/usr/bin/env python3
"""Side-by-side Markdown table of two (or more) models' kvq-eval --json results (for
docs/RESULTS.md): one row per config, each model's PPL and the share of the KIVI-like
baseline's excess over dense that a HeadQ row removes.

Usage: compare_models.py NAME=FILE[,FILE...] NAME=FILE[,FILE...] [--shape WxL] [--only NAME]
                         [--vs-dense] [--configs A,B,...]
  --shape WxL   only rows evaluated on W windows of L tokens (default 32x512)
  --only NAME   only the configs that model NAME has
  --vs-dense    full-KV form: bits per element ((K + V) / 2) and each model's PPL change
                against its dense row, instead of K/V bits and excess removed
  --configs L   only these configs, in this order
excess removed = (PPL_kivi - PPL_x) / (PPL_kivi - PPL_dense), where kivi is the KIVI-like row
with the same target and bits and the same key group (kivi-k2 for headq-k2-r4, kivi-k2-g128
for headq-k2-r4-g128, kivi-kv3 for headq-kv3-a2...); a HeadQ row whose baseline was not
measured gets none. Configs in the order first seen.
"""
import json, sys


def baseline(config):
    """kivi-<k|kv><bits>[-g<G>] for a headq config, or None."""
    parts = config.split("-")
    if parts[0] != "headq":
        return None
    group = next((p for p in parts[2:] if p.startswith("g") and p[1:].isdigit()), None)
    return "-".join(["kivi", parts[1]] + ([group] if group else []))


def main():
    args = sys.argv[1:]
    shape = (32, 512)
    if "--shape" in args:
        i = args.index("--shape")
        w, l = args[i + 1].split("x")
        shape = (int(w), int(l))
        del args[i:i + 2]
    only = None
    if "--only" in args:
        i = args.index("--only")
        only = args[i + 1]
        del args[i:i + 2]
    vs_dense = "--vs-dense" in args
    if vs_dense:
        args.remove("--vs-dense")
    pick = None
    if "--configs" in args:
        i = args.index("--configs")
        pick = args[i + 1].split(",")
        del args[i:i + 2]
    models, order = [], []
    for a in args:
        name, files = a.split("=", 1)
        rows = {}
        for f in files.split(","):
            j = json.load(open(f))
            if (j["windows"], j["window_len"]) != shape:
                continue
            for r in j["rows"]:
                rows.setdefault(r["config"], r)
                if r["config"] not in order:
                    order.append(r["config"])
        models.append((name, rows))
    if pick is not None:
        order = [c for c in pick if c in order]
    second = "vs dense" if vs_dense else "excess removed"
    bit_cols = "| bits/elem |" if vs_dense else "| K bits | V bits |"
    head = "| config " + bit_cols + "".join(" %s PPL | %s %s |" % (n, n, second) for n, _ in models)
    print(head)
    print("|" + "---|" * (2 if vs_dense else 3) + "---|---|" * len(models))
    for c in order:
        if only is not None and c not in dict(models)[only]:
            continue
        bits = next(r for _, rows in models for k, r in rows.items() if k == c)
        if vs_dense:
            line = "| %s | %.2f |" % (c, (bits["k_bits_ctx"] + bits["v_bits_ctx"]) / 2)
        else:
            line = "| %s | %.3f | %.3f |" % (c, bits["k_bits_ctx"], bits["v_bits_ctx"])
        for _, rows in models:
            r = rows.get(c)
            if r is None:
                line += " not measured | |"
                continue
            ex = ""
            b, d = rows.get(baseline(c) or ""), rows.get("dense")
            if vs_dense:
                if d is not None and c != "dense":
                    ex = "%+.1f%%" % (100 * (r["ppl"] / d["ppl"] - 1))
            elif b is not None and d is not None and abs(b["ppl"] - d["ppl"]) > 1e-9:
                ex = "%.1f%% (vs %s)" % (100 * (b["ppl"] - r["ppl"]) / (b["ppl"] - d["ppl"]), baseline(c))
            line += " %.3f | %s |" % (r["ppl"], ex)
        print(line)


if __name__ == "__main__":
    main()
