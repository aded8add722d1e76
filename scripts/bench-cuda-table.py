#!/usr/bin/env python3
"""Prints kvq-bench-cuda JSON runs (--benchmark_out) as Markdown tables, one row per case:
attend time, code GB/s, share of the same run's streaming read, dense fp16 attention's share
and the attend's speedup over it. With two files, adds the second's time against the first's.

Usage: scripts/bench-cuda-table.py [--help] RUN.json [AFTER.json]"""
import json
import sys


def load(path):
    rows = {}
    for b in json.load(open(path))["benchmarks"]:
        _, codec, d, t = b["name"].split("/")[:4]
        rows[(codec, int(d[1:]), int(t[1:]))] = b
    return rows


def main(argv):
    if len(argv) < 2 or argv[1] in ("-h", "--help") or len(argv) > 3:
        print(__doc__)
        return 0 if len(argv) > 1 and argv[1] in ("-h", "--help") else 2
    runs = [load(p) for p in argv[1:]]
    last = runs[-1]
    head = "| codec | d | tokens | attend us | code GB/s | % stream | dense % stream | x dense | splits |"
    if len(runs) == 2:
        head += " us before | after/before |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for key, b in last.items():
        line = (f"| {key[0]} | {key[1]} | {key[2]} | {b['real_time']:.0f} | {b['attend_GBps']:.0f} | "
                f"{100 * b['frac_of_stream']:.1f}% | {100 * b.get('dense_frac_of_stream', b['dense_GBps'] / b['stream_GBps']):.1f}% | "
                f"{b['dense_speedup']:.2f}x | {int(b['splits'])} |")
        if len(runs) == 2 and key in runs[0]:
            before = runs[0][key]["real_time"]
            line += f" {before:.0f} | {b['real_time'] / before:.2f} |"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
