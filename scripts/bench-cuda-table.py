#!/usr/bin/env python3
"""Prints kvq-bench-cuda JSON runs (--benchmark_out) as Markdown tables.

Attend rows: the default (CUDA-core) program's time, its code GB/s and share of the same run's
streaming read, the tensor-core program's time and share where the run has it (tensor_us), the
tensor-core program against the default, and dense fp16 attention's share of the stream and
each program's speedup over it. Encode, Decode and Verify rows (runs that have them): GB/s and
share of the stream. With two files, the Attend table adds the first file's time of the same
case ("before": the tensor-core program where that run timed it, else the default).

Usage: scripts/bench-cuda-table.py [--help] RUN.json [BEFORE.json]"""
import json
import sys


def load(path):
    attend, codec = {}, {}
    for b in json.load(open(path))["benchmarks"]:
        if b.get("error_occurred"):
            continue
        parts = b["name"].split("/")
        if parts[0] == "Attend":
            rows = int(parts[4][4:]) if len(parts) > 4 and parts[4].startswith("rows") else 4
            attend[(parts[1], int(parts[2][1:]), int(parts[3][1:]), rows)] = b
        elif parts[0] in ("Encode", "Decode", "Verify"):
            codec[(parts[0], parts[1], int(parts[2][1:]))] = b
    return attend, codec


def tensor_time(b):
    """The tensor-core program's time in a run, if it was timed."""
    if "tensor_us" in b:
        return b["tensor_us"]
    if b.get("tensor_cores"):  # the first H100 run, where it was the default
        return b["attend_us"]
    return None


def main(argv):
    if len(argv) < 2 or argv[1] in ("-h", "--help") or len(argv) > 3:
        print(__doc__)
        return 0 if len(argv) > 1 and argv[1] in ("-h", "--help") else 2
    attend, codec = load(argv[1])
    before = load(argv[2])[0] if len(argv) == 3 else None
    if not attend:
        head = None
    else:
        head = ("| codec | d | tokens | rows | default us | code GB/s | % stream | tensor us | tensor % stream"
                " | tensor / default | dense % stream | x dense | tensor x dense | splits |")
        if before is not None:
            head += " before us | tensor after/before |"
        print(head)
        print("|" + "---|" * (head.count("|") - 1))
        for key, b in attend.items():
            b.setdefault("attend_us", b["real_time"])  # runs before 2026-12 had no attend_us
            b.setdefault("dense_us", b["real_time"] * b["dense_speedup"])
            t = tensor_time(b)
            stream = b["stream_GBps"]
            dense_frac = b.get("dense_frac_of_stream", b["dense_GBps"] / stream)
            cells = [key[0], key[1], key[2], key[3], f"{b['attend_us']:.0f}", f"{b['attend_GBps']:.0f}",
                     f"{100 * b['frac_of_stream']:.1f}%"]
            if t is not None:
                cells += [f"{t:.0f}", f"{100 * b['frac_of_stream'] * b['attend_us'] / t:.1f}%",
                          f"{b['attend_us'] / t:.2f}x"]
            else:
                cells += ["-", "-", "-"]
            cells += [f"{100 * dense_frac:.1f}%", f"{b['dense_speedup']:.2f}x",
                      f"{b['dense_us'] / t:.2f}x" if t else "-", int(b["splits"])]
            if before is not None:
                old = before.get(key)
                old_t = tensor_time(old) if old else None
                cells += [f"{old_t:.0f}", f"{t / old_t:.2f}"] if old_t and t else ["-", "-"]
            print("| " + " | ".join(str(c) for c in cells) + " |")
    if codec:
        if attend:
            print()
        print("| op | codec | d | GB/s | stream GB/s | % stream |")
        print("|---|---|---|---|---|---|")
        for (op, name, d), b in codec.items():
            rate = b.get(op.lower() + "_GBps")
            print(f"| {op} | {name} | {d} | {rate:.0f} | {b['stream_GBps']:.0f} | "
                  f"{100 * b['frac_of_stream']:.1f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
