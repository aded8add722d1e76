#!/usr/bin/env python3
"""Markdown table from kvq-eval --json files (for docs/RESULTS.md).

Usage: results_table.py RESULTS.json [MORE.json ...]
excess removed = (PPL_kivi - PPL_x) / (PPL_kivi - PPL_dense), with kivi = kivi-<target><bits>
(same windows and window length, from any of the files; the first occurrence of a config
wins, later duplicates are skipped).
"""
import json, sys

rows, seen, ref = [], set(), {}
for f in sys.argv[1:]:
    j = json.load(open(f))
    for r in j["rows"]:
        key = (r["config"], j["windows"], j["window_len"])
        if key in seen:
            continue
        seen.add(key)
        r["shape"] = (j["windows"], j["window_len"])
        rows.append(r)
        ref[key] = r["ppl"]
print("| config | windows x len | PPL | excess removed | K bits (steady) | V bits (steady) | K bits @L | V bits @L | K+V @L | seconds |")
print("|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    c, (w, L) = r["config"], r["shape"]
    ex = ""
    parts = c.split("-")
    if parts[0] == "headq":
        d, k = ref.get(("dense", w, L)), ref.get(("kivi-" + parts[1], w, L))
        if d is not None and k is not None and abs(k - d) > 1e-9:
            ex = "%.1f%%" % (100 * (k - r["ppl"]) / (k - d))
    print("| %s | %dx%d | %.3f | %s | %.3f | %.3f | %.3f | %.3f | %.3f | %.0f |" % (
        c, w, L, r["ppl"], ex, r["k_bits"], r["v_bits"], r["k_bits_ctx"], r["v_bits_ctx"],
        r["k_bits_ctx"] + r["v_bits_ctx"], r["seconds"]))
