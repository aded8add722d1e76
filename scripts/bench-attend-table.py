#!/usr/bin/env python3
"""Attend rows of kvq-bench-codec against fp16 attention and the memory's streaming rate.

Reads one or more Google Benchmark JSON files of kvq-bench-codec (each a run; with
--benchmark_repetitions each repetition is a round) and prints, per head_dim shape, a
markdown table of every attend row (AttendCodec/<codec>/..., AttendCodes*/..., AttendDense/...):

  bits/elem   code bits per K and V element, every header, scale and sink row counted
  ms          CPU time per call (one layer's decode attend)
  x dense     AttendDense time / this row's time, within the same round
  target      0.6 x (fp16 bytes / code bytes): the speed-up the codec's reads aim for
  GB/s        code bytes read per CPU second
  % stream    that rate over StreamRead/threads:1 of the same round (one core reading memory),
              both per CPU second

Figures are medians over the rounds; "range" gives the lowest and highest x dense of the
rounds (the noise). A row meets the targets when its median x dense is at least its target,
and (at 3.05 bits per element or fewer) at least 3x.

Usage: scripts/bench-attend-table.py [--help] RUN.json [RUN.json ...]
Runs: see docs/BENCHMARKS.md, "Attend for every frontier codec".
"""
import argparse
import json
import re
import statistics
import sys

# A row at or below this many bits per element is held to 3x fp16 attention (the goal for "~3
# bits per element and below").
LOW_BITS = 3.05
ATTEND = re.compile(r"^(AttendCodec/(?P<codec>[^/]+)|(?P<kind>AttendCodes\w*|AttendDense))/"
                    r"(?P<shape>T:\d+/d:\d+/q:\d+/kv:\d+)$")


def seconds(b):
    scale = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}[b["time_unit"]]
    return b["cpu_time"] * scale


def stream_rate(b):
    """StreamRead/threads:1 in GB per CPU second, as the attend rows are rated: the row reports
    wall-clock bytes_per_second (UseRealTime), which a preempted run on a shared machine
    deflates; its one thread does all the reading, so CPU time is the reading time."""
    return b["bytes_per_second"] * b["real_time"] / b["cpu_time"] / 1e9


def rounds_of(paths):
    """Yields one {name: benchmark} dict per round: a file, or a repetition within it."""
    for path in paths:
        with open(path) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:  # e.g. a run still writing it
                sys.exit(f"bench-attend-table: {path} is not complete benchmark JSON ({e})")
        by_rep = {}
        for b in data["benchmarks"]:
            if b.get("run_type", "iteration") != "iteration" or b.get("error_occurred"):
                continue
            by_rep.setdefault(b.get("repetition_index", 0), {})[b["run_name"]] = b
        yield from by_rep.values()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", metavar="RUN.json", help="kvq-bench-codec JSON output")
    args = ap.parse_args()

    stats = {}  # (shape, row) -> lists over rounds
    n_rounds = 0
    stream = []
    for rows in rounds_of(args.runs):
        n_rounds += 1
        s1 = rows.get("StreamRead/threads:1/real_time")
        if s1:
            stream.append(stream_rate(s1))
        for name, b in rows.items():
            m = ATTEND.match(name)
            if not m:
                continue
            dense = rows.get("AttendDense/" + m["shape"])
            row = m["codec"] or m["kind"]
            st = stats.setdefault((m["shape"], row), {"bits": b.get("bits_per_elem"),
                                                      "target": b.get("target_x_dense"),
                                                      "ms": [], "x": [], "gbs": [], "pct": []})
            st["ms"].append(seconds(b) * 1e3)
            gbs = b["bytes_per_second"] / 1e9
            st["gbs"].append(gbs)
            if dense:
                st["x"].append(seconds(dense) / seconds(b))
            if s1:
                st["pct"].append(100.0 * gbs / stream_rate(s1))
    if not stats:
        sys.exit("bench-attend-table: no attend rows (AttendCodec/..., AttendCodes.../) in " +
                 ", ".join(args.runs))

    med = lambda xs: statistics.median(xs) if xs else float("nan")
    print(f"{n_rounds} round(s); StreamRead/threads:1 per CPU second " +
          (f"{med(stream):.2f} GB/s (median; {min(stream):.2f}-{max(stream):.2f})"
           if stream else "missing: no % of stream"))
    for shape in sorted({k[0] for k in stats}, key=lambda s: [int(x) for x in re.findall(r"\d+", s)]):
        print(f"\n{shape}\n")
        print("| row | bits/elem | ms | x dense (range) | target | GB/s | % stream | meets |")
        print("|---|---|---|---|---|---|---|---|")
        for (sh, row), st in sorted(stats.items(), key=lambda kv: kv[1]["bits"] or 0):
            if sh != shape:
                continue
            x, target, bits = med(st["x"]), st["target"], st["bits"]
            verdict = "-"
            if row == "AttendDense":
                verdict = "baseline"
            elif st["x"] and target is not None:
                goal = max(target, 3.0) if bits is not None and bits <= LOW_BITS else target
                verdict = "yes" if x >= goal else f"no (< {goal:.2f}x)"
            rng = f" ({min(st['x']):.2f}-{max(st['x']):.2f})" if len(st["x"]) > 1 else ""
            fmt = lambda v, f: format(v, f) if v is not None else "-"
            print(f"| {row} | {fmt(bits, '.2f')} | {med(st['ms']):.2f} | {x:.2f}x{rng} "
                  f"| {fmt(target, '.2f')}x | {med(st['gbs']):.2f} | {med(st['pct']):.0f}% | {verdict} |")


if __name__ == "__main__":
    main()
