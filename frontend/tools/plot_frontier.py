#!/usr/bin/env python3
"""The quality frontier: perplexity over fp16 (%) against bits per element ((K + V) / 2, every
byte counted, at the evaluated context) for kvq's configurations, the KIVI-like ones and
llama.cpp's KV types, with kvq's frontier (the best perplexity at or below each bit count)
drawn as a step line; also prints the dominance table (for every peer point, kvq's best
configuration at no more bits). Each implementation is measured against its own fp16 run on
the same windows (llama.cpp's activations and matmuls differ slightly from kvq's runner).

Usage: plot_frontier.py --out OUT.png --title TITLE --kvq A.json [B.json ...]
                        [--llamacpp LLAMA.json] [--peers PEERS.json ...] [--noise PCT]
                        [--markdown TABLE.md]
kvq-eval --json files (full-KV rows; K-only rows are skipped); the first file holding a config
name wins. A row named dense is needed in the kvq files. --peers: bench_peer_caches.py --json
files (transformers' QuantizedCache rows, each against the file's own dense row; its kvq rows
are left to the kvq-eval files). gnuplot (Debian's gnuplot-nox) draws.
"""
import argparse, json, os, subprocess, sys, tempfile


def load_kvq(files):
    rows, seen, dense = [], set(), None
    for f in files:
        j = json.load(open(f))
        for r in j["rows"]:
            c = r["config"]
            if c in seen:
                continue
            seen.add(c)
            if c == "dense":
                dense = r["ppl"]
                continue
            parts = c.split("-")
            if c != "calibrated" and (len(parts) < 2 or not parts[1].startswith("kv")):
                continue  # K-only rows keep fp16 values: not a point on the full-KV curve
            bits = (r["k_bits_ctx"] + r["v_bits_ctx"]) / 2
            # KIVI-like peers: kvq's base code alone; with kvq's levers (metric rounding,
            # rotation) a rank-0 codec is one of kvq's own configurations.
            levers = {"mr", "rotk", "rotv", "rot"} & set(parts)
            fam = "kivi" if c.startswith("kivi") and not levers else "kvq"
            rows.append({"name": c, "bits": bits, "ppl": r["ppl"], "family": fam})
    if dense is None:
        sys.exit("plot_frontier: no dense row in the kvq files")
    for r in rows:
        r["excess"] = 100.0 * (r["ppl"] / dense - 1)
    return rows, dense


def load_llamacpp(path):
    j = json.load(open(path))
    f16 = [r["ppl"] for r in j["rows"] if r["kv_type"] == "f16"]
    if not f16:
        sys.exit("plot_frontier: no f16 row in " + path)
    out = []
    for r in j["rows"]:
        if r["kv_type"] == "f16":
            continue
        out.append({"name": "llama.cpp " + r["kv_type"], "bits": r["bits_per_element"],
                    "ppl": r["ppl"], "excess": 100.0 * (r["ppl"] / f16[0] - 1),
                    "family": "llama.cpp"})
    return out, f16[0], j.get("llama_cpp_python", "?")


def load_peers(path):
    j = json.load(open(path))
    dense = [r["ppl"] for r in j["rows"] if r["name"].startswith("dense")]
    if not dense:
        sys.exit("plot_frontier: no dense row in " + path)
    return [{"name": "transformers " + r["name"], "bits": r["bits_per_element"], "ppl": r["ppl"],
             "excess": 100.0 * (r["ppl"] / dense[0] - 1), "family": "transformers"}
            for r in j["rows"] if "backend" in r]


def frontier(points):
    best, out = None, []
    for p in sorted(points, key=lambda p: (p["bits"], p["excess"])):
        if best is None or p["excess"] < best["excess"]:
            best = p
            out.append(p)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", required=True)
    ap.add_argument("--kvq", nargs="+", required=True)
    ap.add_argument("--llamacpp")
    ap.add_argument("--peers", nargs="*", default=[])
    ap.add_argument("--noise", type=float, default=0.7, help="margin in %% of PPL called noise")
    ap.add_argument("--markdown", help="also write the dominance table here")
    a = ap.parse_args()
    rows, dense = load_kvq(a.kvq)
    peers = [r for r in rows if r["family"] == "kivi"]
    version = None
    lc = []
    if a.llamacpp:
        lc, _, version = load_llamacpp(a.llamacpp)
    for f in a.peers:
        lc += load_peers(f)
    peers += lc
    ours = [r for r in rows if r["family"] == "kvq"]
    front = frontier(ours)
    lines = ["| peer | bits/elem | vs fp16 | kvq at <= bits | bits/elem | vs fp16 | kvq below? |",
             "|---|---|---|---|---|---|---|"]
    for p in sorted(peers, key=lambda p: p["bits"]):
        cand = [o for o in ours if o["bits"] <= p["bits"] + 1e-9]
        b = min(cand, key=lambda o: o["excess"]) if cand else None
        if b is None:
            verdict = "no kvq point at these bits"
        elif b["excess"] < p["excess"]:
            verdict = "yes" if p["excess"] - b["excess"] > a.noise else "yes, within noise"
        else:
            verdict = "no" if b["excess"] - p["excess"] > a.noise else "no, within noise"
        lines.append("| %s | %.2f | %+.1f%% | %s | %s | %s | %s |" % (
            p["name"], p["bits"], p["excess"], b["name"] if b else "-",
            "%.2f" % b["bits"] if b else "-", "%+.1f%%" % b["excess"] if b else "-", verdict))
    table = "\n".join(lines)
    print(table)
    if a.markdown:
        open(a.markdown, "w").write(table + "\n")
    # Points far above the rest (llama.cpp's q4_0 on Qwen2.5: +159%) would squash the curve:
    # they are listed in a label instead.
    cap = 25.0
    allpts = rows + lc
    off = [r for r in allpts if r["excess"] > cap]
    tmp = tempfile.mkdtemp()
    plots = []
    styles = {"kvq": "pt 7 ps 1.3 lc rgb '#1f77b4'", "kivi": "pt 4 ps 1.4 lc rgb '#ff7f0e'",
              "llama.cpp": "pt 9 ps 1.6 lc rgb '#d62728'", "transformers": "pt 11 ps 1.6 lc rgb '#2ca02c'"}
    titles = {"kvq": "kvq (HeadQ) configurations", "kivi": "KIVI-like (the base code alone, no levers)",
              "llama.cpp": "llama.cpp KV types (%s)" % (
                  "llama-cpp-python %s, flash attention" % version
                  if version and version[0].isdigit() else version),
              "transformers": "transformers QuantizedCache (quanto, HQQ; residual 128 counted)"}
    for fam in ("kvq", "kivi", "llama.cpp", "transformers"):
        pts = [r for r in allpts if r["family"] == fam and r["excess"] <= cap]
        if not pts:
            continue
        p = os.path.join(tmp, fam + ".dat")
        with open(p, "w") as f:
            for r in sorted(pts, key=lambda r: r["bits"]):
                f.write("%f %f %s\n" % (r["bits"], r["excess"], r["name"].replace(" ", "_")))
        plots.append("'%s' using 1:2 with points %s title '%s', '' using 1:2:3 with labels "
                     "offset 0.5,0.4 left font ',7' notitle" % (p, styles[fam], titles[fam]))
    fp = os.path.join(tmp, "front.dat")
    with open(fp, "w") as f:
        for r in front:
            f.write("%f %f\n" % (r["bits"], min(r["excess"], cap)))
    plots.insert(0, "'%s' using 1:2 with steps lw 2 lc rgb '#1f77b4' title 'kvq frontier'" % fp)
    script = """set terminal pngcairo size 1100,700 noenhanced
set output '%s'
set title '%s (fp16 PPL %.3f)'
set xlabel 'bits per element, (K + V) / 2, every byte counted'
set ylabel 'perplexity over fp16 (%%)'
set grid
set key top right
set yrange [-1:%g]
%s
plot %s
""" % (a.out, a.title, dense, cap,
       ("set label 'off the chart: %s' at graph 0.02, graph 0.96 font ',9'" %
        ", ".join("%s (%.2f bits, %+.0f%%)" % (r["name"], r["bits"], r["excess"]) for r in off))
       if off else "", ", ".join(plots))
    sp = os.path.join(tmp, "plot.gp")
    open(sp, "w").write(script)
    subprocess.run(["gnuplot", sp], check=True)


if __name__ == "__main__":
    main()
