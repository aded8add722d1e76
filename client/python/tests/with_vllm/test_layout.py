"""kvq.vllm.layout against vLLM's CPU KV writer: the learned index equals the documented
packing (AMX VNNI tiles; the vector path's transposed K and token-major V), and K/V written by
vLLM's own op come back exactly through gather, and kvq's paged writer (ModelCodes.decode_into
through CpuBlockLayout.paged) writes what that op writes."""

import pytest

# Skipped where vllm is not installed (the test venv of scripts/test-python.sh).
pytest.importorskip("vllm.config", reason="vllm is not installed in this venv: scripts/test-vllm.sh makes "
                    "the vLLM venv and runs these tests")

import torch  # noqa: E402
from vllm import _custom_ops as ops  # noqa: E402

import kvq.codes  # noqa: E402
from kvq._proto.kvq.v1 import kvq_pb2  # noqa: E402
from kvq.tensors import to_tensor  # noqa: E402
from kvq.vllm.layout import CpuBlockLayout  # noqa: E402

D = 64  # SmolLM2's head size


def _documented(isa: str, bs: int):
    t, d = torch.arange(bs)[:, None], torch.arange(D)[None, :]
    if isa == "amx":  # K [t/16][d/2][16][2], V [d/16][t/2][16][2]
        return ((t // 16) * (D * 16) + (d // 2) * 32 + (t % 16) * 2 + d % 2,
                (d // 16) * (bs * 16) + (t // 2) * 32 + (d % 16) * 2 + t % 2)
    return d * bs + t, t * D + d  # K transposed [d][t], V token-major [t][d]


CASES = [("vec", 128, torch.float32), ("vec", 128, torch.bfloat16), ("vec16", 16, torch.bfloat16)]
if torch.cpu._is_amx_tile_supported():
    CASES.insert(0, ("amx", 128, torch.bfloat16))


@pytest.mark.parametrize("isa,bs,dtype", CASES)
def test_layout_is_the_documented_packing_and_round_trips(isa, bs, dtype):
    layout = CpuBlockLayout.probe(isa, bs, D, dtype)
    k_doc, v_doc = _documented(isa, bs)
    assert torch.equal(layout.k_index, k_doc) and torch.equal(layout.v_index, v_doc)

    heads, blocks, n = 3, [5, 1, 3], 2 * bs + bs // 2 + 3  # odd length: the last block is partial
    g = torch.Generator().manual_seed(7)
    k = torch.randn(n, heads, D, generator=g).to(dtype)
    v = torch.randn(n, heads, D, generator=g).to(dtype)
    slots = torch.cat([torch.arange(bs) + b * bs for b in blocks])[:n]
    by_vllm = torch.zeros(6, heads, bs, 2 * D, dtype=dtype)
    key_cache, value_cache = by_vllm.view(6, heads, 2 * bs, D).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)

    gk, gv = layout.gather(by_vllm, blocks, n)
    assert torch.equal(gk, k.transpose(0, 1)) and torch.equal(gv, v.transpose(0, 1))

    # kvq's own writer (window rows of a GetBlocks message, decoded into the cache through the
    # learned layout) writes the bytes vLLM's op writes.
    codes = kvq.codes.ModelCodes.from_basis({"model": "m", "version": 1, "layers": 1, "kv_heads": heads,
                                             "q_heads": heads, "head_dim": D, "basis_rank": 0})
    wire = {torch.bfloat16: "bf16", torch.float32: "f32"}[dtype]
    msg = kvq_pb2.GetBlocksResponse(layer=0, start=0, layer_tokens=n,
                                    keys=to_tensor(k.transpose(0, 1).contiguous(), "keys", dtype=wire),
                                    values=to_tensor(v.transpose(0, 1).contiguous(), "values", dtype=wire))
    by_kvq = torch.zeros_like(by_vllm)
    paged = layout.paged(heads)
    assert codes.decode_into(msg, codes.default_codec, by_kvq, paged, paged.block_offsets(blocks), 0, n) == n
    full = blocks[:2]  # whole blocks are byte-equal; the partial one holds the n tokens
    assert torch.equal(by_kvq[full], by_vllm[full])
    tail = layout.gather(by_kvq, blocks[2:], n - 2 * bs)
    assert torch.equal(tail[0], k.transpose(0, 1)[:, 2 * bs:]) and torch.equal(tail[1], v.transpose(0, 1)[:, 2 * bs:])
    # Not vacuous: another block order reads other tokens.
    assert not torch.equal(layout.gather(by_vllm, blocks[::-1], n)[0], gk)
