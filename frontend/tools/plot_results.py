#!/usr/bin/env python3
"""Plots perplexity against combined effective K+V bits per element (at the evaluated
context) from one or more kvq-eval --json files, with gnuplot (Debian's gnuplot-nox).
Dense (fp16, 32 bits) is drawn as a horizontal reference line. Pass files evaluated on the
same windows only (perplexities of different window sets are not comparable).

Usage: plot_results.py OUT.png TITLE RESULTS.json [MORE.json ...]
Rows with the same config name in several files: the first file wins.
"""
import json, os, subprocess, sys, tempfile


def main():
    out, title, files = sys.argv[1], sys.argv[2], sys.argv[3:]
    dense = None
    rows, seen = [], set()
    for f in files:
        j = json.load(open(f))
        for r in j["rows"]:
            if r["config"] in seen:
                continue
            seen.add(r["config"])
            r["label"] = "%s (%dx%d)" % (r["config"], j["windows"], j["window_len"])
            rows.append(r)
    fams = {"dense": [], "kivi-k": [], "headq-k": [], "kivi-kv": [], "headq-kv": [], "control": []}
    for r in rows:
        c = r["config"]
        bits = r["k_bits_ctx"] + r["v_bits_ctx"]
        if c == "dense":
            dense = r["ppl"]
            continue
        elif "random" in c or "wrongsign" in c:
            fam = "control"
        else:
            fam = c.split("-")[0] + "-" + ("kv" if c.split("-")[1].startswith("kv") else "k")
        fams[fam].append((bits, r["ppl"], c))
    # Points far above dense (the wrong-sign control) would squash the rest: list them instead.
    off = []
    if dense is not None:
        for fam in fams:
            keep = []
            for b, ppl, c in fams[fam]:
                (keep if ppl <= 1.6 * dense else off).append((b, ppl, c))
            fams[fam] = [p for p in keep if p[1] <= 1.6 * dense]
    tmp = tempfile.mkdtemp()
    plots = []
    styles = {"dense": "pt 7 ps 1.6 lc rgb '#000000'", "kivi-k": "pt 5 ps 1.2 lc rgb '#d62728'",
              "headq-k": "pt 7 ps 1.2 lc rgb '#1f77b4'", "kivi-kv": "pt 4 ps 1.4 lc rgb '#ff7f0e'",
              "headq-kv": "pt 6 ps 1.4 lc rgb '#2ca02c'", "control": "pt 2 ps 1.2 lc rgb '#7f7f7f'"}
    for fam, pts in fams.items():
        if not pts:
            continue
        p = os.path.join(tmp, fam + ".dat")
        with open(p, "w") as f:
            for b, ppl, c in sorted(pts):
                f.write("%f %f %s\n" % (b, ppl, c))
        plots.append("'%s' using 1:2 with points %s title '%s', '' using 1:2:3 with labels "
                     "offset 0.6,0.4 left font ',7' notitle" % (p, styles[fam], fam))
    if dense is not None:
        plots.append("%f with lines dt 2 lc rgb '#000000' title 'dense fp16 (32 bits), PPL %.3f'" % (dense, dense))
    script = """set terminal pngcairo size 1100,700 noenhanced
set output '%s'
set title '%s'
set xlabel 'K + V effective bits per element at the evaluated context'
set ylabel 'perplexity (llama.cpp protocol, WikiText-2 test)'
set grid
set key top right
%s
plot %s
""" % (out, title,
       ("set label 'off the chart: %s' at graph 0.02, graph 0.96 font ',9'" %
        ", ".join("%s (PPL %.1f)" % (c, p) for b, p, c in off)) if off else "",
       ", ".join(plots))
    sp = os.path.join(tmp, "plot.gp")
    open(sp, "w").write(script)
    subprocess.run(["gnuplot", sp], check=True)


if __name__ == "__main__":
    main()
