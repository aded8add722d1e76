#!/usr/bin/env bash
# Runs kvq-bench-codec and prints a markdown table of the results with the ratios that matter
# (EncodeKV / Memcpy throughput, AttendDense / AttendCodes and AttendRef / AttendCodes time,
# AttendCodesNoVerify / AttendCodes), every ratio from baselines measured in the same run.
# Times are CPU times of single-threaded iterations (robust to other processes' preemption).
# DecodeKV / Memcpy and MemcpyReused; AttendSplit's 2-thread speedup beside StreamRead's (wall
# clock: these rows use two threads).
# Usage: scripts/bench-codec.sh [--help] [--quick] [--filter REGEX] [--out FILE.json]
#   --quick   short runs (0.1 s per benchmark) for a smoke check
#   --filter  only the benchmarks matching REGEX (Google Benchmark's --benchmark_filter)
set -euo pipefail
MIN_TIME=1.0
OUT=""
FILTER="."
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --quick) MIN_TIME=0.1; shift ;;
    --out) OUT="$2"; shift 2 ;;
    --filter) FILTER="$2"; shift 2 ;;
    *) echo "bench-codec: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."
BIN="${KVQ_BUILD_DIR:-build}/bin/kvq-bench-codec"
[[ -x "$BIN" ]] || { echo "bench-codec: $BIN not built (run scripts/test.sh or cmake --build build)" >&2; exit 1; }
JSON="${OUT:-$(mktemp --suffix=.json)}"
"$BIN" --benchmark_min_time="$MIN_TIME" --benchmark_filter="$FILTER" --benchmark_out="$JSON" --benchmark_out_format=json >&2
python3 - "$JSON" <<'PY'
import json, sys, re
d = json.load(open(sys.argv[1]))
ctx = d["context"]
rows = {b["name"]: b for b in d["benchmarks"]}
print(f"Machine: {ctx.get('num_cpus')} CPUs @ {ctx.get('mhz_per_cpu')} MHz, kernels: {ctx.get('kernels')}, "
      f"caches: " + ", ".join(f"L{c['level']} {c['size']//1024} KiB" for c in ctx.get("caches", [])) + "\n")
print("| shape | EncodeKV GB/s | Memcpy GB/s | Encode/Memcpy |")
print("|---|---|---|---|")
for name, b in rows.items():
    if name.startswith("EncodeKV/"):
        shape = name[len("EncodeKV/"):]
        m = rows.get("Memcpy/" + shape)
        e = b["bytes_per_second"] / 1e9
        mm = m["bytes_per_second"] / 1e9 if m else float("nan")
        print(f"| {shape} | {e:.2f} | {mm:.2f} | {e/mm:.3f}x |")
print()
print("| shape | AttendCodes us | AttendDense us | AttendRef us | Dense/Codes | Ref/Codes | NoVerify/Codes | Dense/CodesG128 |")
print("|---|---|---|---|---|---|---|---|")
def t(b):  # CPU time of the (single-threaded) iteration, in microseconds
    return b["cpu_time"] if b["time_unit"] == "us" else b["cpu_time"] / 1e3
for name, b in rows.items():
    if name.startswith("AttendCodes/"):
        shape = name[len("AttendCodes/"):]
        c = t(b)
        dn = rows.get("AttendDense/" + shape)
        rf = rows.get("AttendRef/" + shape)
        nv = rows.get("AttendCodesNoVerify/" + shape)
        dv = t(dn) if dn else float("nan")
        rv = t(rf) if rf else float("nan")
        g1 = rows.get("AttendCodesG128/" + shape)
        nvs = f"{t(nv)/c:.2f}x" if nv else "-"
        g1s = f"{dv/t(g1):.2f}x" if g1 else "-"
        print(f"| {shape} | {c:.0f} | {dv:.0f} | {rv:.0f} | {dv/c:.2f}x | {rv/c:.1f}x | {nvs} | {g1s} |")
def gbs(name):
    b = rows.get(name)
    return b["bytes_per_second"] / 1e9 if b else float("nan")
if any(n.startswith("DecodeKV/") for n in rows):
    print()
    print("| shape | DecodeKV (f16) GB/s | DecodeKVF32 | DecodeKVRef | Memcpy | MemcpyReused | Decode/Memcpy | Decode/MemcpyReused |")
    print("|---|---|---|---|---|---|---|---|")
    for name in rows:
        if name.startswith("DecodeKV/"):
            shape = name[len("DecodeKV/"):]
            dk, mc, mr = gbs(name), gbs("Memcpy/" + shape), gbs("MemcpyReused/" + shape)
            print(f"| {shape} | {dk:.2f} | {gbs('DecodeKVF32/' + shape):.2f} | {gbs('DecodeKVRef/' + shape):.2f} "
                  f"| {mc:.2f} | {mr:.2f} | {dk/mc:.2f}x | {dk/mr:.2f}x |")
def wall(b):  # wall-clock time of the iteration, in microseconds
    return b["real_time"] if b["time_unit"] == "us" else b["real_time"] / 1e3
s1, s2 = rows.get("StreamRead/threads:1/real_time"), rows.get("StreamRead/threads:2/real_time")
if any(n.startswith("AttendSplit/") for n in rows):
    print()
    if s1 and s2:
        print(f"StreamRead: 1 thread {s1['bytes_per_second']/1e9:.2f} GB/s, 2 threads "
              f"{s2['bytes_per_second']/1e9:.2f} GB/s: {wall(s1)/wall(s2):.2f}x\n")
    print("| shape | 1 part 1 thread us | 2 parts 1 thread us | 2 parts 2 threads us | speedup (1p1t / 2p2t) | 2 threads, worker spins 100 us | speedup | split cost (2p1t / 1p1t) |")
    print("|---|---|---|---|---|---|---|---|")
    for name in rows:
        if name.startswith("AttendSplit/") and "/parts:1/threads:1" in name:
            shape = name[len("AttendSplit/"):name.index("/parts:")]
            a = wall(rows[name])
            b1 = rows.get(f"AttendSplit/{shape}/parts:2/threads:1/real_time")
            b2 = rows.get(f"AttendSplit/{shape}/parts:2/threads:2/real_time")
            b3 = rows.get(f"AttendSplit/{shape}/parts:2/threads:2/spin_us:100/real_time")
            sp = f"{wall(b3):.0f} | {a/wall(b3):.2f}x" if b3 else "- | -"
            if b1 and b2:
                print(f"| {shape} | {a:.0f} | {wall(b1):.0f} | {wall(b2):.0f} | {a/wall(b2):.2f}x | {sp} | {wall(b1)/a:.3f}x |")
PY
