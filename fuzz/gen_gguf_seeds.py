#!/usr/bin/env python3
"""Writes fuzz_gguf's seeds (fuzz/corpus/gguf/): tiny valid GGUF v3 files, each under 4 KB.

  types      one small tensor of every type the reader decodes (F32, F16, BF16, Q4_0, Q4_1,
             Q5_0, Q8_0, Q4_K, Q6_K) and one it does not (IQ2_XXS), with a Llama's metadata
             (the keys of tests/frontend/tiny_model.cc)
  metadata   a value of each of the 13 metadata types, integer and string arrays, alignment 64
  tokenizer  a GPT-2 byte-level BPE tokenizer (256 byte tokens, a few merges), no tensors
  tiny_llama a Llama the model loader accepts (1 layer, hidden 8, 2 query heads, 1 KV head,
             FFN 8, vocabulary 4: the tensors of tests/frontend/tiny_model.cc, smaller), F32
  empty      no metadata, no tensors

Usage: fuzz/gen_gguf_seeds.py [OUT_DIR]   (default fuzz/corpus/gguf)
"""
import os
import random
import struct
import sys

U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
SCALAR = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f",
          BOOL: "<?", U64: "<Q", I64: "<q", F64: "<d"}
# GGML type id -> (block elements, block bytes)
LAYOUT = {0: (1, 4), 1: (1, 2), 30: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22),
          8: (32, 34), 12: (256, 144), 14: (256, 210), 16: (256, 66)}


def s(x):
    b = x.encode() if isinstance(x, str) else x
    return struct.pack("<Q", len(b)) + b


def value(t, v):
    if t == STRING:
        return s(v)
    if t == ARRAY:
        et, items = v
        return struct.pack("<IQ", et, len(items)) + b"".join(value(et, i) for i in items)
    return struct.pack(SCALAR[t], v)


def gguf(kv, tensors, alignment=32):
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv))
    for key, t, v in kv:
        out += s(key) + struct.pack("<I", t) + value(t, v)
    offsets, off = [], 0
    for name, dims, ty, data in tensors:
        out += s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", ty, off)
        offsets.append(off)
        off += (len(data) + alignment - 1) // alignment * alignment
    out += b"\0" * (-len(out) % alignment)
    start = len(out)
    for (name, dims, ty, data), o in zip(tensors, offsets):
        out += b"\0" * (start + o - len(out)) + data
    return out


def tensor(rng, name, dims, ty):
    n = 1
    for d in dims:
        n *= d
    bs, bb = LAYOUT[ty]
    if ty == 0:
        data = b"".join(struct.pack("<f", rng.uniform(-2, 2)) for _ in range(n))
    elif ty == 1:
        data = b"".join(struct.pack("<e", rng.uniform(-2, 2)) for _ in range(n))
    else:  # random blocks with small fp16 scales where the type has them
        data = bytes(rng.randrange(256) for _ in range(n // bs * bb))
        if ty in (2, 3, 6, 8, 12):
            blocks = [bytearray(data[i:i + bb]) for i in range(0, len(data), bb)]
            for b in blocks:
                b[0:2] = struct.pack("<e", 0.01)
                if ty in (3, 12):
                    b[2:4] = struct.pack("<e", 0.02)
            data = b"".join(bytes(b) for b in blocks)
    return (name, dims, ty, data)


def byte_tokens():
    toks, n = [], 0
    for b in range(256):
        printable = 33 <= b <= 126 or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF
        cp = b if printable else 256 + n
        n += 0 if printable else 1
        toks.append(chr(cp))
    return toks


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "corpus", "gguf")
    os.makedirs(out_dir, exist_ok=True)
    rng = random.Random(14)
    llama = [("general.architecture", STRING, "llama"), ("llama.block_count", U32, 2),
             ("llama.embedding_length", U32, 128), ("llama.attention.head_count", U32, 2),
             ("llama.attention.head_count_kv", U32, 1), ("llama.feed_forward_length", U32, 96),
             ("llama.attention.layer_norm_rms_epsilon", F32, 1e-5),
             ("llama.rope.freq_base", F32, 10000.0)]
    types = [tensor(rng, "f32", [4], 0), tensor(rng, "f16", [2, 2], 1),
             tensor(rng, "bf16", [2], 30), tensor(rng, "q4_0", [32], 2),
             tensor(rng, "q4_1", [32], 3), tensor(rng, "q5_0", [32], 6),
             tensor(rng, "q8_0", [32, 2], 8), tensor(rng, "q4_k", [256], 12),
             tensor(rng, "q6_k", [256], 14), tensor(rng, "iq2_xxs", [256], 16)]
    metadata = [("u8", U8, 200), ("i8", I8, -5), ("u16", U16, 60000), ("i16", I16, -300),
                ("u32", U32, 4000000000), ("i32", I32, -7), ("f32", F32, 0.5),
                ("bool", BOOL, True), ("string", STRING, "text"), ("u64", U64, 1 << 40),
                ("i64", I64, -(1 << 40)), ("f64", F64, 2.5),
                ("ints", ARRAY, (I32, [1, -2, 3])), ("strs", ARRAY, (STRING, ["a", "\u0120b"])),
                ("general.alignment", U32, 64)]
    toks = byte_tokens()
    merges = ["\u0120 t", "h e", "\u0120t h", "i n", "e r", "\u0120 a", "o n"]
    vocab = toks + [m.replace(" ", "") for m in merges]
    tokenizer = [("tokenizer.ggml.model", STRING, "gpt2"), ("tokenizer.ggml.pre", STRING, "smollm"),
                 ("tokenizer.ggml.tokens", ARRAY, (STRING, vocab)),
                 ("tokenizer.ggml.merges", ARRAY, (STRING, merges)),
                 ("tokenizer.ggml.bos_token_id", U32, 1), ("tokenizer.ggml.add_bos_token", BOOL, False)]
    H, F, V, KV = 8, 8, 4, 4
    tiny = [("general.architecture", STRING, "llama"), ("llama.block_count", U32, 1),
            ("llama.embedding_length", U32, H), ("llama.attention.head_count", U32, 2),
            ("llama.attention.head_count_kv", U32, 1), ("llama.feed_forward_length", U32, F),
            ("llama.attention.layer_norm_rms_epsilon", F32, 1e-5), ("llama.rope.freq_base", F32, 10000.0)]
    shapes = [("token_embd.weight", [H, V]), ("output_norm.weight", [H]),
              ("blk.0.attn_norm.weight", [H]), ("blk.0.attn_q.weight", [H, H]),
              ("blk.0.attn_k.weight", [H, KV]), ("blk.0.attn_v.weight", [H, KV]),
              ("blk.0.attn_output.weight", [H, H]), ("blk.0.ffn_norm.weight", [H]),
              ("blk.0.ffn_gate.weight", [H, F]), ("blk.0.ffn_up.weight", [H, F]),
              ("blk.0.ffn_down.weight", [F, H])]
    tiny_rng = random.Random(15)  # its own: the other seeds stay as they were
    tiny_tensors = [tensor(tiny_rng, name, dims, 0) for name, dims in shapes]
    files = {"types": gguf(llama, types), "tiny_llama": gguf(tiny, tiny_tensors), "metadata": gguf(metadata, [tensor(rng, "t", [3], 0)], 64),
             "tokenizer": gguf(tokenizer, []), "empty": gguf([], [])}
    for name, data in files.items():
        assert len(data) < 4096, (name, len(data))
        with open(os.path.join(out_dir, name), "wb") as f:
            f.write(data)


if __name__ == "__main__":
    main()
