"""KvqCache: a transformers Cache whose layers keep no K/V; kvq holds them.

One kvq sequence per row of the batch (ids on the cache: `sequence_ids`). Every forward
sends, per layer, one Attend with one item per sequence: the rows' new K/V as the item's
append (start = the tokens the server holds), the queries with causal_offset = that start
and the module's scaling. Padded rows (left padding of a batch of prompts of different
lengths) are dropped before sending, so each server-side sequence holds only its real
tokens; their outputs are zeros (transformers ignores them).

Prefix sharing (share=True): each append carries the token ids of its rows (taken from the
forward's input_ids by the pre-hook kvq.hf.enable installs). `attach_prefix(input_ids)`
starts an empty sequence from the server's prefix index (an Append with token_ids and no
keys/values per layer) and returns the matched length m; from then on get_seq_length()
reports m, so `model.generate(input_ids, past_key_values=cache)` prefills only tokens m..
(generate slices input_ids by the cache's length; position ids come from the full attention
mask, so the rest keep their positions). `generate_with_prefix` does both.

Lifetime: close() (or leaving a `with` block, or garbage collection) deletes the sequences.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, cast

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..errors import KvqError
from ..types import Append, AttendItem, CodecSettings
from .attention import cache_kwarg, set_pending

__all__ = ["KvqCache", "KvqCacheStats", "faithful_chunks", "generate_with_prefix"]

_KV_DTYPES = ("f16", "bf16", "f32")
_MAX_QUERIES = 1024  # per item (docs/API.md limits)
_MAX_ITEMS = 4096    # per batched call


@dataclass
class KvqCacheStats:
    attend_calls: int = 0   # Attend RPCs (one per layer and forward)
    attend_items: int = 0   # items in them (one per sequence with rows)
    rpc_seconds: float = 0.0  # wall time inside client.attend (serialize, RPC, decode)
    tokens_sent: int = 0    # rows appended, summed over layers and sequences
    attach_calls: int = 0
    tokens_attached: int = 0  # per sequence (not per layer)


class KvqLayer(CacheLayerMixin):
    """Counts the positions transformers has seen (padded); keeps no tensors."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self) -> None:
        super().__init__()
        self.seen = 0
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        self.seen += int(key_states.shape[-2])
        return key_states, value_states

    def get_mask_sizes(self, query_length: int):
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.seen = 0

    def offload(self):
        pass

    def prefetch(self):
        pass


class KvqCache(Cache):
    """A transformers Cache whose K/V live in kvq (see the module docstring)."""

    def __init__(
        self,
        client: Any,
        model: Any,
        *,
        batch_size: int = 1,
        sequence_ids: Optional[Sequence[str]] = None,
        codec: Optional[CodecSettings] = None,
        kv_dtype: str = "f16",
        share: bool = False,
        observe: Optional[bool] = None,
        faithful: bool = True,
    ) -> None:
        """client: a kvq.Client. model: the ModelInfo (pb) that register_basis /
        register_model returned, or a registered model name (fetched with GetModel).
        kv_dtype: the wire dtype of K/V ("f16" as the reference frontend sends,
        "bf16", or "f32": every token at the model's precision). codec: overrides of
        the model's defaults for these new sequences. share: send token ids (prefix
        sharing). observe: AttendItem.observe (default: True only for the A^2 value
        policy, which needs it; False makes Attend read-only and retryable). faithful: cut
        each forward's rows at the codec's encode boundaries (see chunks; still one Attend
        per layer) so that a prompt's rows are the same bytes however it is split, which
        makes prefix attach bit-exact; False sends each sequence's rows as one item."""
        if isinstance(model, str):
            model = client.get_model(model)
        if kv_dtype not in _KV_DTYPES:
            raise KvqError.invalid("KvqCache", f"kv_dtype: '{kv_dtype}' is not one of {_KV_DTYPES}")
        if sequence_ids is None:
            tag = uuid.uuid4().hex[:16]
            sequence_ids = [f"hf-{tag}-{b}" for b in range(batch_size)]
        sequence_ids = list(sequence_ids)
        if not sequence_ids or len(set(sequence_ids)) != len(sequence_ids):
            raise KvqError.invalid("KvqCache", "sequence_ids: need distinct ids, one per batch row")
        n_layers = int(model.layers)
        # Typed as KvqLayer here (Cache.layers holds the base classes' union).
        self._layers: List[KvqLayer] = [KvqLayer() for _ in range(n_layers)]
        super().__init__(layers=cast(List[Any], self._layers))
        self.client = client
        self.info = model
        self.sequence_ids = sequence_ids
        self.codec = codec
        self.kv_dtype = kv_dtype
        self.share = share
        policy = codec.value_policy if codec is not None else None  # None: the model's
        if policy is None:
            policy = "a2" if model.codec.value_policy == 2 else "uniform"
        self.observe = (policy == "a2") if observe is None else observe
        g = codec.key_group if codec is not None and codec.key_group is not None else int(model.codec.key_group)
        self.key_group = g or 32
        w = codec.window if codec is not None and codec.window is not None else int(model.codec.window)
        self.window = max(0, w)
        self.faithful = faithful
        # Tokens each server-side sequence holds, per layer.
        self.lengths = [[0] * len(sequence_ids) for _ in range(n_layers)]
        self.created = [False] * len(sequence_ids)
        self.stats = KvqCacheStats()
        self._ids: Optional[Any] = None  # this forward's input_ids [B, n] (from the pre-hook)
        self._closed = False
        self._maybe_exists = False  # an attach that took nothing may have made the sequence

    # -- what transformers calls ---------------------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if self._closed:
            raise RuntimeError("KvqCache: closed (its sequences were deleted)")
        self._layers[layer_idx].update(key_states, value_states)
        set_pending(self, layer_idx, key_states, value_states)
        return key_states, value_states

    @property
    def batch_size(self) -> int:
        return len(self.sequence_ids)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._layers[layer_idx].seen if layer_idx < len(self._layers) else 0

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("KvqCache: kvq sequences cannot be truncated")

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("KvqCache: beam search is not supported (sequences are not forked)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise NotImplementedError("KvqCache: num_return_sequences / beams > 1 are not supported")

    def batch_select_indices(self, indices) -> None:
        raise NotImplementedError("KvqCache: batch selection is not supported")

    # -- the pre-hook ------------------------------------------------------------------
    def note_input_ids(self, input_ids) -> None:
        self._ids = input_ids

    # -- attention -----------------------------------------------------------------------
    def _wire(self, t):
        if self.kv_dtype == "f16":
            return t.to(torch.float16)
        if self.kv_dtype == "bf16":
            return t.to(torch.bfloat16)
        return t.to(torch.float32)

    def chunks(self, start: int, m: int) -> List[Tuple[int, int]]:
        """(position, length) pieces of rows [start, start + m) such that no piece holds
        queries on both sides of an encode: an append that brings a layer to B = encoded +
        R + G tokens encodes a group, so a piece stops at count B - 1 and the next starts
        with the token that triggers the encode (as ForwardDecodeFaithful in the C++
        frontend). Every query then sees the encoded / arrival-precision split it would
        see decoding one token at a time, whatever the length of the forward it is in.
        Pieces also stay within the server's 1024 queries per item."""
        if not self.faithful:
            return [(p, min(_MAX_QUERIES, start + m - p)) for p in range(start, start + m, _MAX_QUERIES)]
        return faithful_chunks(start, m, self.key_group, self.window, _MAX_QUERIES)

    def attend_layer(self, layer: int, query, key, value, scaling: float, attention_mask=None):
        """One Attend for all sequences of the batch at this layer. query [B, QH, n, D],
        key/value [B, KVH, n, D] (the new rows only); returns [B, n, QH, D]. Each
        sequence's rows go as one item per decode-faithful piece (see chunks), pieces of
        one sequence in order (the server runs items naming one sequence in order)."""
        B, QH, n, D = query.shape
        if B != len(self.sequence_ids):
            raise KvqError.invalid(
                "Attend", f"batch of {B} rows but the KvqCache has {len(self.sequence_ids)} sequences")
        rows: List[Optional[Any]] = [None] * B
        if attention_mask is not None:
            real = attention_mask[:, -n:].bool()
            for b in range(B):
                if not bool(real[b].all()):
                    rows[b] = real[b].nonzero().flatten()
        ids = None
        if self.share:
            if self._ids is None or tuple(self._ids.shape) != (B, n):
                raise KvqError.invalid(
                    "Attend", "share: the token ids of this forward are unknown (call "
                    "kvq.hf.enable(model) so that input_ids reach the cache; inputs_embeds "
                    "cannot share)")
            ids = self._ids.detach().cpu().numpy().astype(np.int64)
        q32 = query.detach().to(torch.float32)
        kw, vw = self._wire(key.detach()), self._wire(value.detach())
        items, which = [], []
        version = int(self.info.version)
        for b in range(B):
            r = rows[b]
            qb, kb, vb = q32[b], kw[b], vw[b]
            idb = None if ids is None else ids[b]
            if r is not None:
                if r.numel() == 0:
                    continue
                qb, kb, vb = qb[:, r], kb[:, r], vb[:, r]
                idb = None if idb is None else idb[r.numpy()]
            m = int(kb.shape[1])
            start = self.lengths[layer][b]
            for pos, ln in self.chunks(start, m):
                i0 = pos - start
                sl = slice(i0, i0 + ln)
                app = Append(
                    sequence_id=self.sequence_ids[b], layer=layer, start=pos,
                    keys=kb[:, sl].contiguous(), values=vb[:, sl].contiguous(),
                    basis_version=version,
                    token_ids=None if idb is None else idb[sl],
                )
                if pos == 0 and not self.created[b]:
                    app.model = self.info.model
                    app.codec = self.codec
                items.append(AttendItem(
                    sequence_id=self.sequence_ids[b], layer=layer, queries=qb[:, sl].contiguous(),
                    causal_offset=pos, scale=scaling, observe=self.observe,
                    output_dtype="f32", basis_version=version, append=app))
                which.append((b, i0, ln))
        out = torch.zeros((B, n, QH, D), dtype=query.dtype, device=query.device)
        if not items:
            return out
        t0 = time.perf_counter()
        results = []
        for c in range(0, len(items), _MAX_ITEMS):
            results.extend(self.client.attend(items[c : c + _MAX_ITEMS]))
            self.stats.attend_calls += 1
        self.stats.rpc_seconds += time.perf_counter() - t0
        self.stats.attend_items += len(items)
        per_seq: Dict[int, List[Any]] = {}
        for (b, _i0, ln), res in zip(which, results, strict=True):
            self.created[b] = True
            self.lengths[layer][b] += ln
            self.stats.tokens_sent += ln
            per_seq.setdefault(b, []).append(torch.from_numpy(res.outputs))
        for b, parts in per_seq.items():
            o = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
            o = o.transpose(0, 1).to(dtype=query.dtype, device=query.device)  # [m, QH, D]
            r = rows[b]
            if r is None:
                out[b] = o
            else:
                out[b, r.to(query.device)] = o
        return out

    # -- prefix sharing --------------------------------------------------------------------
    def attach_prefix(self, input_ids) -> int:
        """Attaches the longest run of whole key groups of input_ids[0] (all but its last
        token: generation needs that one's logits) that the server's prefix index holds.
        Returns the tokens attached (a multiple of G, maybe 0); get_seq_length() reports
        it from then on. Batch size 1, empty sequence, share=True."""
        if not self.share:
            raise KvqError.invalid("PutBlocks", "attach: the KvqCache needs share=True")
        if len(self.sequence_ids) != 1:
            raise KvqError.invalid("PutBlocks", "attach: batch size 1 only (one matched length per cache)")
        if any(self.created) or self.get_seq_length() != 0:
            raise KvqError.invalid("PutBlocks", "attach: only to an empty cache")
        ids = np.asarray(input_ids.detach().cpu() if hasattr(input_ids, "detach") else input_ids)
        ids = ids.reshape(-1) if ids.ndim == 1 else ids[0]
        limit = (len(ids) - 1) // self.key_group * self.key_group
        seq = self.sequence_ids[0]
        while limit > 0:
            appends = [Append(sequence_id=seq, layer=li, start=0, token_ids=ids[:limit],
                              model=self.info.model, basis_version=int(self.info.version),
                              codec=self.codec) for li in range(len(self.layers))]
            t0 = time.perf_counter()
            resp = self.client.put_blocks(appends)
            self.stats.rpc_seconds += time.perf_counter() - t0
            self.stats.attach_calls += 1
            self.created[0] = True
            got = {ln.layer: int(ln.tokens) for ln in resp.lengths if ln.sequence_id == seq}
            per_layer = [got.get(li, 0) for li in range(len(self.layers))]
            lo, hi = min(per_layer), max(per_layer)
            if lo == hi == 0:
                # Nothing indexed: the sequence may exist, empty; the first append names the
                # model and codec again (allowed: they match), and close() deletes it.
                self.created[0] = False
                self._maybe_exists = True
                return 0
            if lo == hi:
                for li in range(len(self.layers)):
                    self.lengths[li][0] = lo
                    self._layers[li].seen = lo
                self.stats.tokens_attached += lo
                return lo
            # Layers disagree (part of the index evicted meanwhile): start over up to the
            # shortest, as the C++ frontend does.
            self.client.delete_sequence(seq)
            self.created[0] = False
            limit = lo
        return 0

    # -- lifetime ------------------------------------------------------------------------
    def close(self) -> None:
        """Deletes the server-side sequences (those that exist); idempotent."""
        if self._closed:
            return
        self._closed = True
        for b, sid in enumerate(self.sequence_ids):
            if not (self.created[b] or (b == 0 and self._maybe_exists)):
                continue
            try:
                self.client.delete_sequence(sid)
            except KvqError as e:
                if e.code.name != "NOT_FOUND":
                    raise

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass



def faithful_chunks(start: int, m: int, key_group: int, window: int,
                    max_len: Optional[int] = None) -> List[Tuple[int, int]]:
    """(position, length) pieces of rows [start, start + m) of a codec of key group G and window R
    such that no piece holds queries on both sides of an encode (kvq-eval's decode-faithful
    chunking, LlamaModel::ForwardDecodeFaithfulBatch): an append that brings a layer to B =
    encoded + R + G tokens encodes a group, so a piece stops at count B - 1 and the next starts
    with the token whose append triggers the encode. max_len: pieces no longer (None: no limit)."""
    G, R = key_group, window
    out, pos, end = [], start, start + m
    while pos < end:
        enc = (pos - R) // G * G if pos >= R + G else 0
        b = enc + R + G
        if b <= pos + 1:
            b += G
        ln = min(end - pos, b - 1 - pos)
        if max_len is not None:
            ln = min(ln, max_len)
        out.append((pos, ln))
        pos += ln
    return out


def generate_with_prefix(model: Any, cache: Any, input_ids: Any, **generate_kwargs: Any):
    """attach_prefix + model.generate over the full prompt (transformers prefills only the
    tokens after the attached length). Returns (generate's output, tokens attached)."""
    attached = cache.attach_prefix(input_ids)
    out = model.generate(input_ids, **{cache_kwarg(model): cache}, **generate_kwargs)
    return out, attached
