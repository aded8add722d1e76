#!/usr/bin/env python3
"""Perplexity of llama.cpp's own quantized KV-cache types, the peers on kvq's quality frontier.

llama.cpp (through the PyPI package llama-cpp-python, which compiles it on install) runs the
same GGUF on the same text with kvq-eval's protocol (llama.cpp's perplexity: consecutive
windows of L tokens from token 0, each a fresh sequence, the second half scored), once per KV
type; quantized V caches need flash attention, so every run uses it. CI does not run this
(about 8 minutes per type for Qwen2.5-0.5B at 32 x 512 on 2 cores); its JSON is committed.

Usage:
  python3 -m venv /tmp/venv && /tmp/venv/bin/pip install llama-cpp-python numpy
  /tmp/venv/bin/python frontend/tools/llamacpp_kv_types.py \\
      --model "$(scripts/fetch-model.sh qwen2.5-coder-0.5b)" \\
      --text "${KVQ_DATA_DIR:-../shared/data}/wikitext-2/wiki.test.raw" --windows 32 \\
      --window-len 512 \\
      --types f16,q8_0,q5_1,q5_0,q4_1,iq4_nl,q4_0,q8_0/q4_0 --json OUT.json

Bits per element are llama.cpp's block sizes (every scale counted): q8_0 8.5, q5_1 6, q5_0 5.5,
q4_1 5, q4_0 and iq4_nl 4.5, f16 16; a K/V pair counts (K + V) / 2.
"""
import argparse, json, sys, time

import numpy as np
import llama_cpp

BITS = {"f16": 16.0, "q8_0": 8.5, "q5_1": 6.0, "q5_0": 5.5, "q4_1": 5.0, "q4_0": 4.5, "iq4_nl": 4.5}
GGML = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0,
        "q5_1": llama_cpp.GGML_TYPE_Q5_1, "q5_0": llama_cpp.GGML_TYPE_Q5_0,
        "q4_1": llama_cpp.GGML_TYPE_Q4_1, "q4_0": llama_cpp.GGML_TYPE_Q4_0,
        "iq4_nl": llama_cpp.GGML_TYPE_IQ4_NL}


def perplexity(llm, ids, windows, L, label):
    nll, n, t0 = 0.0, 0, time.time()
    for w in range(windows):
        llm.reset()
        llm.eval(ids[w * L:(w + 1) * L])
        # Logits at positions L/2 .. L-2 predict tokens L/2+1 .. L-1 of the window.
        rows = np.array(llm.scores[L // 2:L - 1], dtype=np.float64)
        targets = np.array(ids[w * L + L // 2 + 1:(w + 1) * L])
        mx = rows.max(axis=1)
        lse = np.log(np.exp(rows - mx[:, None]).sum(axis=1)) + mx
        nll += float((lse - rows[np.arange(len(targets)), targets]).sum())
        n += len(targets)
        done = (w + 1) / windows
        sys.stderr.write("\r%-12s %3d%% %5.0fs eta %5.0fs" % (
            label, 100 * done, time.time() - t0, (time.time() - t0) * (1 - done) / done))
        sys.stderr.flush()
    sys.stderr.write("\n")
    return float(np.exp(nll / n)), n, time.time() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="GGUF file")
    ap.add_argument("--text", required=True, help="evaluation text (wiki.test.raw)")
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--window-len", type=int, default=512)
    ap.add_argument("--types", default="f16,q8_0,q5_1,q5_0,q4_1,iq4_nl,q4_0,q8_0/q4_0",
                    help="comma-separated KV types; K/V for different key and value types")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", required=True, help="output file (rewritten after every type)")
    a = ap.parse_args()
    text = open(a.text, encoding="utf-8").read()
    rows = []
    for spec in a.types.split(","):
        k, v = (spec.split("/") + [spec])[:2]
        if k not in GGML or v not in GGML:
            sys.exit("unknown KV type in '%s' (known: %s)" % (spec, ", ".join(GGML)))
        llm = llama_cpp.Llama(model_path=a.model, n_ctx=a.window_len, n_batch=a.window_len,
                              logits_all=True, n_threads=a.threads, verbose=False,
                              flash_attn=True, type_k=GGML[k], type_v=GGML[v])
        ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
        if len(ids) < a.windows * a.window_len:
            sys.exit("text has %d tokens, need %d" % (len(ids), a.windows * a.window_len))
        ppl, n, secs = perplexity(llm, ids, a.windows, a.window_len, spec)
        rows.append({"kv_type": spec, "type_k": k, "type_v": v, "ppl": ppl,
                     "bits_per_element": (BITS[k] + BITS[v]) / 2, "scored_tokens": n,
                     "seconds": round(secs, 1)})
        print("%-12s bits %5.2f  PPL %.4f  (%d tokens, %.0f s)" % (spec, rows[-1]["bits_per_element"], ppl, n, secs))
        del llm
        out = {"llama_cpp_python": llama_cpp.__version__,
               "system_info": llama_cpp.llama_print_system_info().decode(),
               "model": a.model, "text": a.text, "windows": a.windows,
               "window_len": a.window_len, "flash_attn": True, "rows": rows}
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
