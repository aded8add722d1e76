"""kvq.vllm.KvqConnector: vLLM's KV connector (KVConnectorBase_V1) backed by a kvq server.

Loaded by module path:
    KVTransferConfig(kv_connector="KvqConnector", kv_connector_module_path="kvq.vllm",
                     kv_role="kv_both", kv_connector_extra_config={"address": ..., "model": ...})

Mapping (docs/DESIGN.md "kvq behind vLLM"): a prompt is stored once, whole (its partial last
block included), as one kvq sequence named after its token ids (kvq.vllm.naming), K and V as
the engine computed them, with the token ids (so that kvq's per-tenant prefix index stores a
group shared by several prompts once). A new request's lookup is one MatchPrefix call (no K/V
moves): the length of the sequence named after its whole prompt and of every block-aligned
prefix name, and the longest run of groups kvq's prefix index holds for its token ids (the
shared part of prompts that share only a prefix, such as a system prompt); when the index
holds more than any name, the prompt's ids are attached to a fresh sequence (a second call),
which then holds that run. A stored whole prompt loads all but its last token (vLLM computes
one); otherwise the longer prefix loads in whole blocks. The worker reads it with GetBlocks
into the request's blocks of the paged cache (kvq.vllm.layout: the CPU backend's packed
layout), on a thread beside the forward pass, each attention layer waiting for its own layer
(kvq.vllm.layer_loads; overlap_loads=false: before the forward pass). A prompt is saved in the
step whose forward computes its last token, one PutBlocks message for all layers (atomic: a
lookup never sees half a prompt), from copies of the K/V
gathered during the step (so vLLM may free the blocks when the step ends): by default
synchronously at the end of the step; with save_buffer_mb > 0 on a background thread, the
pending copies bounded in bytes and saves past the bound dropped and counted
(kvq.vllm.save_queue).

Failure: a lookup that fails or runs past lookup_deadline_s is a miss; a load that fails
reports its blocks through get_block_ids_with_load_errors (with
kv_load_failure_policy="recompute" vLLM recomputes them); a save that fails is logged and
counted, never raised into the engine.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

import kvq

from .config import KvqConnectorConfig
from .layer_loads import LayerLoads
from .layout import CpuBlockLayout
from .naming import PrefixNames
from .save_queue import SaveQueue

__all__ = ["KvqConnector", "register_command"]

log = logging.getLogger("kvq.vllm")

_WIRE_DTYPES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
_MAX_MATCH_IDS = 65536  # MatchPrefix's limit: longer prompts match their first 64k tokens


@dataclass
class LoadSpec:
    """Worker: read tokens [start, end) of sequence `name` into the request's blocks."""

    name: str
    block_ids: List[int]
    start: int
    end: int
    attached: bool = False  # `name` is an attach sequence: deleted once read


@dataclass
class SaveSpec:
    """Worker: store the first `tokens` tokens held by block_ids as sequence `name`."""

    name: str
    block_ids: List[int]
    tokens: int
    token_ids: List[int]


@dataclass
class KvqConnectorMetadata(KVConnectorMetadata):
    loads: List[LoadSpec] = field(default_factory=list)
    saves: List[SaveSpec] = field(default_factory=list)


@dataclass
class _Lookup:
    names: List[str]   # the prompt's prefix names, 1..n whole blocks
    whole: str         # the name of the whole prompt (names.whole), "" for a prompt under one block
    whole_stored: bool  # kvq holds the whole prompt under `whole` (nothing to save)
    load_tokens: int   # what may be loaded (never the prompt's last token: vLLM computes it)
    # The sequence the load reads: `whole`, names[k], or an attach sequence holding the
    # prompt's longest run of groups in kvq's prefix index (then `attached`: the worker
    # deletes it after the load, request_finished when no load took it).
    source: str = ""
    attached: bool = False


@dataclass
class _Track:
    """Scheduler: a running request's blocks and whether its prompt still needs saving."""

    prompt: List[int]
    lookup: _Lookup
    blocks: List[int] = field(default_factory=list)
    saved: bool = False


def register_command(model: str, address: str) -> str:
    """What registers a model in kvq, for the error of an unregistered one."""
    return (f"kvq models register DIR --server {address} (DIR: what kvq-calibrate --out wrote), or without a "
            f"basis from Python: kvq.hf.register_model(kvq.Client({address!r}), "
            f"transformers.AutoConfig.from_pretrained(MODEL_FOLDER), {model!r})")


class KvqConnector(KVConnectorBase_V1):
    """Prefix K/V of vLLM requests stored in and loaded from kvq (see the module's doc)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.config = KvqConnectorConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        c = self.config
        self.client = kvq.Client(c.address, tenant=c.tenant, token=c.token, deadline=c.deadline_s,
                                 allow_insecure_token=c.allow_insecure_token, router=c.router)
        self.model_info = self._check_model(vllm_config)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.dtype: torch.dtype = vllm_config.model_config.dtype
        if self.dtype not in _WIRE_DTYPES:
            raise ValueError(f"kvq.vllm: model dtype {self.dtype} is not bfloat16, float16 or float32")
        cache_dtype = str(vllm_config.cache_config.cache_dtype)
        if cache_dtype != "auto":
            raise ValueError(f"kvq.vllm: kv_cache_dtype {cache_dtype!r}: only 'auto' (the model's dtype) is supported")
        self.codec = kvq.CodecSettings(**c.codec) if c.codec else None
        self.names = PrefixNames(c.model, self.block_size, {
            "version": self.model_info.version, "fingerprint": self.model_info.fingerprint,
            "codec": c.codec or {}, "dtype": str(self.dtype)})
        # Scheduler state.
        self._lookups: Dict[str, _Lookup] = {}
        self._loads: Dict[str, LoadSpec] = {}
        self._tracks: Dict[str, _Track] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvq-drop")
        # Worker state.
        self._caches: Dict[str, torch.Tensor] = {}
        self._layer_index: Dict[str, int] = {}
        self._layout: Optional[CpuBlockLayout] = None
        self._pending: Dict[str, List[kvq.Append]] = {}
        self._saves = SaveQueue(int(c.save_buffer_mb * 2**20)) if c.save_buffer_mb > 0 else None
        self._failed_blocks: Set[int] = set()
        self._loads_running: Optional[LayerLoads] = None
        self._step_loads: List[LoadSpec] = []  # the running step's
        self._lock = threading.Lock()
        # Counters (read by tests and logged at shutdown).
        self.counts: Dict[str, float] = {
            "lookups": 0, "lookup_errors": 0, "hit_tokens": 0, "attached_tokens": 0, "loads": 0, "load_errors": 0,
            "loaded_tokens": 0,
            "saves": 0, "save_errors": 0, "saved_tokens": 0, "saves_dropped": 0,
            # Wall seconds inside the connector: the lookups, the loads (on their thread; of
            # which in GetBlocks' stream, the rest writing the paged cache), the forward pass
            # waiting for loaded layers, the saves' gathers and PutBlocks.
            "lookup_s": 0.0, "load_s": 0.0, "load_wait_s": 0.0, "save_gather_s": 0.0,
            "save_rpc_s": 0.0}

    # -- start-up -------------------------------------------------------------------------
    def _check_model(self, vllm_config: Any) -> Any:
        c = self.config
        try:
            info = self.client.get_model(c.model)
        except kvq.KvqError as e:
            if e.code.name == "NOT_FOUND":
                raise RuntimeError(f"kvq.vllm: model {c.model!r} is not registered in kvq at {c.address}; "
                                   f"register it first: {register_command(c.model, c.address)}") from None
            raise RuntimeError(f"kvq.vllm: cannot reach kvq at {c.address} to check model {c.model!r}: {e}") from e
        mc, pc = vllm_config.model_config, vllm_config.parallel_config
        want = {"layers": mc.get_num_layers(pc), "kv_heads": mc.get_num_kv_heads(pc), "head_dim": mc.get_head_size()}
        have = {k: int(getattr(info, k)) for k in want}
        if want != have:
            raise RuntimeError(f"kvq.vllm: kvq model {c.model!r} is registered with {have}, the engine's model has "
                               f"{want}: register this model under another name "
                               f"({register_command(c.model, c.address)})")
        return info

    # -- scheduler side -------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[Optional[int], bool]:
        found = self._lookups.get(request.request_id)
        if found is None:
            found = self._lookup(list(request.prompt_token_ids or []))
            self._lookups[request.request_id] = found
        if found.load_tokens <= num_computed_tokens:
            return 0, False
        return found.load_tokens - num_computed_tokens, False

    def _lookup(self, prompt: List[int]) -> _Lookup:
        names = self.names.chain(prompt)
        whole = self.names.whole(prompt, names) if names else ""
        last = max(0, (len(prompt) - 1) // self.block_size)  # whole blocks that may be loaded
        stored, attached, probe, whole_stored = 0, 0, "", False
        t0 = time.monotonic()
        if names:
            self.counts["lookups"] += 1
            try:
                # One round trip, no K/V: the length of the whole prompt's name and of every
                # prefix name (stored prompts, their window included) and the longest run of
                # groups kvq's prefix index holds for the prompt's ids (what other prompts
                # stored that this one shares: a common system prompt before different
                # questions).
                ids = prompt[:min(last * self.block_size, _MAX_MATCH_IDS)]
                asked = names if whole == names[-1] else names + [whole]
                match = self.client.match_prefix(ids, sequence_ids=asked, model=self.config.model, codec=self.codec,
                                                 deadline=self.config.lookup_deadline_s)
                lengths = list(match.sequence_tokens)
                whole_stored = lengths[len(asked) - 1] >= len(prompt)
                for i, tokens in enumerate(lengths[:len(names)]):
                    if tokens >= (i + 1) * self.block_size:
                        stored = i + 1
                # The index holds more than any name: attach the prompt's ids to a fresh
                # sequence (a second round trip, only when it pays), which the load reads.
                if not whole_stored and min(match.indexed_tokens // self.block_size, last) > min(stored, last):
                    probe = self.names.attach_name(names)
                    attached = self._attach(probe, ids[:match.indexed_tokens]) // self.block_size
            except Exception as e:  # a slow or failing kvq is a miss, never an error
                self.counts["lookup_errors"] += 1
                log.warning("kvq.vllm: prefix lookup failed, treated as a miss: %s", e)
                stored = attached = 0
                whole_stored = False
        if whole_stored:  # all but the last token, which vLLM computes
            if probe:
                self._drop(probe)
            found = _Lookup(names, whole, True, len(prompt) - 1, whole)
        elif min(attached, last) > min(stored, last):
            found = _Lookup(names, whole, False, min(attached, last) * self.block_size, probe, True)
            self.counts["attached_tokens"] += found.load_tokens
        else:
            if probe:
                self._drop(probe)
            found = _Lookup(names, whole, False, min(stored, last) * self.block_size,
                            names[stored - 1] if stored else "")
        self.counts["hit_tokens"] += found.load_tokens
        self.counts["lookup_s"] += time.monotonic() - t0
        return found

    def _attach(self, name: str, ids: List[int]) -> int:
        """Attaches the longest run of indexed groups for ids to a new sequence `name` (every
        layer, one message); the tokens every layer got (whole groups of the codec)."""
        arr = np.asarray(ids, dtype=np.uint32)
        got = self.client.put_blocks(
            [kvq.Append(name, layer, 0, token_ids=arr, model=self.config.model, codec=self.codec)
             for layer in range(int(self.model_info.layers))], deadline=self.config.lookup_deadline_s)
        lengths = [int(x.tokens) for x in got.lengths if x.sequence_id == name]
        return min(lengths) if len(lengths) == int(self.model_info.layers) else 0

    def _drop(self, name: str) -> None:
        """Deletes an attach sequence in the background (a failure only leaves it to eviction)."""
        def drop() -> None:
            try:
                self.client.delete_sequence(name, deadline=self.config.lookup_deadline_s)
            except kvq.KvqError as e:
                if e.code.name != "NOT_FOUND":
                    log.warning("kvq.vllm: deleting attach sequence %s failed: %s", name, e)
        self._pool.submit(drop)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        found = self._lookups[request.request_id]
        end = found.load_tokens
        # From the stored whole prompt, the longest stored prefix or the attach sequence, each
        # of which may hold more than is loaded (never the prompt's last token).
        self._loads[request.request_id] = LoadSpec(found.source, [], end - num_external_tokens, end,
                                                   found.attached)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = KvqConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            prompt = list(new.prompt_token_ids or [])
            found = self._lookups.get(new.req_id) or self._lookup(prompt)
            track = self._tracks[new.req_id] = _Track(prompt, found, list(new.block_ids[0]))
            self._step(new.req_id, track, new.num_computed_tokens + scheduled.get(new.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            known = self._tracks.get(rid)
            if known is None:
                continue
            track = known
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids and new_ids is not None:
                track.blocks = list(new_ids[0])  # a resumed request's block list is given whole
            elif new_ids is not None:
                track.blocks.extend(new_ids[0])
            self._step(rid, track, cached.num_computed_tokens[i] + scheduled.get(rid, 0), meta)
        return meta

    def _step(self, rid: str, track: _Track, computed_after: int, meta: KvqConnectorMetadata) -> None:
        load = self._loads.pop(rid, None)
        if load is not None:
            load.block_ids = list(track.blocks)
            meta.loads.append(load)
            track.lookup.attached = False  # the worker deletes the attach sequence after reading it
        # A prompt of at least one whole block is saved whole, partial last block included.
        if track.saved or not track.lookup.whole or track.lookup.whole_stored:
            return
        tokens = len(track.prompt)
        if computed_after >= tokens:  # this step's forward computes the prompt's last token
            nblocks = -(-tokens // self.block_size)
            meta.saves.append(SaveSpec(track.lookup.whole, track.blocks[:nblocks], tokens, track.prompt))
            track.saved = True

    def request_finished(self, request: Any, block_ids: List[int]) -> tuple[bool, Optional[Dict[str, Any]]]:
        # Saves complete inside the step that scheduled them: nothing holds the blocks longer.
        track = self._tracks.pop(request.request_id, None)
        found = self._lookups.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        lookup = track.lookup if track is not None else found  # the same object when both exist
        if lookup is not None and lookup.attached:  # an attach no load took
            lookup.attached = False
            self._drop(lookup.source)
        return False, None

    # -- worker side ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        self._caches = dict(kv_caches)
        self._layer_index = {name: extract_layer_index(name) for name in kv_caches}
        for name, cache in kv_caches.items():
            if cache.dim() != 4 or int(cache.shape[2]) != self.block_size:
                raise RuntimeError(f"kvq.vllm: layer {name}'s KV cache has shape {tuple(cache.shape)}, not the CPU "
                                   f"backend's [num_blocks, kv_heads, {self.block_size}, 2 * head_size]")

    def _layout_of(self, layer_name: str, cache: torch.Tensor) -> CpuBlockLayout:
        if self._layout is None:
            layer = self._vllm_config.compilation_config.static_forward_context.get(layer_name)
            isa = getattr(layer, "isa", None)
            if isa is None:
                from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

                isa = _get_attn_isa(cache.dtype, self.block_size, int(cache.shape[3]) // 2, "auto")
            self._layout = CpuBlockLayout.probe(isa, self.block_size, int(cache.shape[3]) // 2, cache.dtype)
            log.info("kvq.vllm: CPU KV layout of isa %s learned from vLLM's writer", isa)
        return self._layout

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._end_loads()  # a step whose wait_for_save never came (none expected)
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not meta.loads:
            return
        for name, cache in self._caches.items():  # learned here, on the engine's thread
            self._layout_of(name, cache)
            break
        # On a thread of their own: each layer's attention waits for that layer only
        # (wait_for_layer_load), so the stream and the decode of later layers overlap the
        # forward pass of earlier ones.
        self._step_loads = list(meta.loads)
        self._loads_running = LayerLoads(len(self._layer_index),
                                         [functools.partial(self._load, load) for load in meta.loads])
        if not self.config.overlap_loads:
            self._end_loads()

    def _load(self, load: LoadSpec, step: LayerLoads) -> None:
        by_layer = {idx: name for name, idx in self._layer_index.items()}
        want = load.end - load.start
        got: Dict[int, int] = {}
        self.counts["loads"] += 1
        t0 = time.monotonic()
        try:
            # The soft deadline bounds the stream (each attempt: only UNAVAILABLE, which a dead
            # server answers at once, is retried), so a slow or stopped kvq costs about this
            # much before vLLM recomputes the blocks. The stream is layer after layer.
            # Decoded straight into the paged cache through the layout learned from vLLM's
            # writer (no intermediate tensor, no second pass through the writer); each write
            # held under step.writing(), which refuses once the forward pass stopped waiting.
            caches = {idx: self._caches[name] for idx, name in by_layer.items()}
            some = next(iter(self._caches.values()))
            paged = self._layout_of(by_layer[0], some).paged(int(some.shape[1]))
            for layer, n in self.client.get_blocks_into(load.name, caches, paged, load.block_ids,
                                                        from_token=load.start, to_token=load.end,
                                                        dtype=_WIRE_DTYPES[self.dtype], writing=step.writing,
                                                        deadline=self.config.load_deadline_s):
                got[layer] = got.get(layer, 0) + n
                if got[layer] == want:
                    step.layer_written(layer)
            short = {layer: n for layer, n in got.items() if n != want}
            if len(got) != len(by_layer) or short:
                raise RuntimeError(f"sequence {load.name} held {got} tokens per layer, {want} wanted")
            self.counts["loaded_tokens"] += want
        except Exception as e:  # never fail the request: its blocks are recomputed (policy "recompute")
            self.counts["load_errors"] += 1
            first, last = load.start // self.block_size, -(-load.end // self.block_size)
            with self._lock:
                self._failed_blocks.update(load.block_ids[first:last])
            log.warning("kvq.vllm: loading %s [%d, %d) failed, its blocks are reported as load errors: %s",
                        load.name, load.start, load.end, e)
        if load.attached:
            self._drop(load.name)
        took = time.monotonic() - t0
        self.counts["load_s"] += took

    def wait_for_layer_load(self, layer_name: str) -> None:
        step, layer = self._loads_running, self._layer_index.get(layer_name)
        if step is None or layer is None:
            return
        t0 = time.monotonic()
        # The stream's own deadline ends a slow load first; past twice that the step is given
        # up (its blocks reported as failed loads) rather than stalling the forward pass.
        if not step.wait(layer, 2 * self.config.load_deadline_s + 1):
            self._give_up()
        self.counts["load_wait_s"] += time.monotonic() - t0

    def _give_up(self) -> None:
        """Every block of the step's loads reported failed (some may be half written)."""
        with self._lock:
            for load in self._step_loads:
                first, last = load.start // self.block_size, -(-load.end // self.block_size)
                self._failed_blocks.update(load.block_ids[first:last])
        log.warning("kvq.vllm: loads of this step still running after %.1f s; their blocks are recomputed",
                    2 * self.config.load_deadline_s + 1)

    def _end_loads(self) -> None:
        """Waits for the step's loads (each bounded by its deadline) before its saves and its
        load-error report; none writes into the paged cache afterwards."""
        step, self._loads_running = self._loads_running, None
        if step is not None and not step.join(2 * self.config.load_deadline_s + 1):
            self._give_up()
        self._step_loads = []

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not meta.saves:
            return
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        layout = self._layout_of(layer_name, kv_layer)
        t0 = time.monotonic()
        for save in meta.saves:
            k, v = layout.gather(kv_layer, save.block_ids, save.tokens)
            self._pending.setdefault(save.name, []).append(kvq.Append(
                save.name, layer, 0, keys=k.clone(), values=v.clone(),
                token_ids=np.asarray(save.token_ids, dtype=np.uint32), model=self.config.model, codec=self.codec))
        self.counts["save_gather_s"] += time.monotonic() - t0

    def wait_for_save(self) -> None:
        self._end_loads()
        pending, self._pending = self._pending, {}
        for name, appends in pending.items():
            if self._saves is None:
                self._put(name, appends)
                continue
            nbytes = sum(a.keys.nbytes + a.values.nbytes for a in appends)
            if not self._saves.submit(functools.partial(self._put, name, appends), nbytes):
                with self._lock:
                    self.counts["saves_dropped"] += 1
                log.warning("kvq.vllm: save of %s dropped: %d bytes of saves already pending (save_buffer_mb)",
                            name, self._saves.pending_bytes)

    def _put(self, name: str, appends: List[kvq.Append]) -> None:
        """One prompt's PutBlocks (all layers); a failure is logged and counted, never raised."""
        t0 = time.monotonic()
        try:
            self.client.put_blocks(sorted(appends, key=lambda a: a.layer))
            with self._lock:
                self.counts["saves"] += 1
                self.counts["saved_tokens"] += int(appends[0].keys.shape[1])
        except kvq.KvqError as e:
            # ALREADY_EXISTS: another engine stored these ids first (with other bytes); a miss
            # either way for nobody, so only counted.
            with self._lock:
                self.counts["save_errors"] += 1
            log.warning("kvq.vllm: saving %s failed (a later request recomputes it): %s", name, e)
        with self._lock:
            self.counts["save_rpc_s"] += time.monotonic() - t0

    def get_block_ids_with_load_errors(self) -> Set[int]:
        with self._lock:
            failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def shutdown(self) -> None:
        self._end_loads()
        if self._saves is not None and not self._saves.close(timeout=self.config.deadline_s):
            log.warning("kvq.vllm: saves still pending at shutdown were abandoned")
        log.info("kvq.vllm: %s", self.counts)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()
