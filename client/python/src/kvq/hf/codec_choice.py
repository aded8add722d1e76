"""Choosing the codec for a transformers model (kvq-calibrate-hf --bits): what
`kvq-calibrate --bits` does for a GGUF model of kvq's own frontend (frontend/src/codec_search.cc,
frontend/tools/calibrate_main.cc), with the model's own transformers forward pass.

The search, stage by stage (the same names, stages and criterion as kvq-calibrate's):

1. key lever: the probe codec (LEVER_PROBE) with each of KEY_LEVERS ("", metric rounding,
   + the oblique pair, + keys rotated by H); the oblique lever is tried only where an oblique
   pair was calibrated (<entry>/oblique, which kvq-calibrate-hf --bits writes);
2. sink lever: the probe with that lever and SINK_LEVER (four fp16 sinks): taken when it lowers
   the probe's perplexity;
3. dense-and-sparse lever: the probe so far with the sparse lever (with_sparse_lever): taken
   when it lowers the probe's perplexity by at least SPARSE_LEVER_MIN_GAIN;
4. every name of CANDIDATES with the key lever (and once more with the sinks, and with the
   sparse lever, when they paid), those over the largest budget or the basis rank skipped;
   each budget then takes choose_within's row.

Criterion: perplexity over `windows` windows of `window_len` tokens of the calibration text
that follow the basis's calibration tokens (held out: no token both fitted the basis and chose
the codec; never the evaluation text), llama.cpp's protocol (the second half of each window
scored), decode-faithful: each window runs in pieces cut at the codec's encode boundaries
(cache.faithful_chunks), and every layer attends over its K/V as kvq serves them: sent as fp16,
encoded by kvq's own codec in-process (kvq.codes, the native module: the server's blocks byte for
byte) and decoded back (the groups as GetBlocks decodes them, the window rows at fp16), exactly
what kvq-eval's CodecCache reads. Bits per element are counted from the codec's own blocks (one
group encoded), as kvq-calibrate's SteadyStateBits: (K + V) / 2 of 8 * block bytes / (G *
head_dim), plus the fp16 sinks' rows at window_len tokens.

The choice rule (choose_within): among the rows within the budget, those whose perplexity is
within NOISE_MARGIN of the lowest are near-ties, and the one with the fewest bits wins (then
the earlier row), so that noise in the arithmetic cannot flip the choice between codecs that
are equal within it. kvq-calibrate's ChooseWithin applies the same rule with the same margin
(codec_search.h kChoiceNoiseMargin; the test holds the two equal).

The names here mirror codec_search.cc's; tests/test_codec_choice.py reads that file and
fails when a list or constant differs, so the two searches stay in step.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, cast

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..types import CodecSettings

__all__ = ["CANDIDATES", "KEY_LEVERS", "LEVER_PROBE", "NOISE_MARGIN", "SINK_LEVER", "SPARSE_LEVER_MIN_GAIN",
           "SPARSE_LEVER_PERMILLE", "CodecChoice", "CodecRow", "choose_codec", "choose_within",
           "codec_of_name", "codec_perplexity", "model_codes", "plan_rows", "stored_prefix_perplexity",
           "with_key_lever", "with_sparse_lever"]

# kvq-calibrate's candidate list (codec_search.cc CodecSearchCandidates), kvq-eval config names
# of full-KV codecs; bits per element at head_dim 64 in codec_search.cc's comments.
CANDIDATES: Tuple[str, ...] = (
    "kivi-kv2-g128-vg64",
    "headq-kv2-g128-s4-vg64",
    "kivi-kv2-g128",
    "headq-kv2-g128-vg64",
    "headq-kv2-g128-s4",
    "headq-kv2-g128",
    "headq-kv3-g128-s4-v2-vg64",
    "kivi-kv3-g128-v2",
    "headq-kv3-g128-s4-v2",
    "headq-kv3-g128-v2",
    "headq-kv2-g128-v3",
    "kivi-kv4-g128-v2",
    "kivi-kv3-g128",
    "headq-kv3-g128-vg64",
    "headq-kv3-g128",
    "kivi-kv3",
    "headq-kv4-g128-v3",
    "kivi-kv4-g128-vg64",
    "kivi-kv4-g128",
    "headq-kv4-g128",
    "kivi-kv4",
    "kivi-kv4-g128-v8-vg64",
    "headq-kv4-g128-v8-vg64",
    "kivi-kv8-g128-vg64",
    "kivi-kv8-g128",
    "kivi-kv8-vg64",
    "kivi-kv8",
)
# codec_search.h KeyLevers, kLeverProbe, kSinkLever, kSparseLeverPermille, kSparseLeverMinGain.
KEY_LEVERS: Tuple[str, ...] = ("", "mr", "obl-mr", "rotk-mr")
LEVER_PROBE = "headq-kv2-g128"
SINK_LEVER = "sink4"
SPARSE_LEVER_PERMILLE = 5
SPARSE_LEVER_MIN_GAIN = 0.01
# The choice's noise margin: perplexities within this fraction of the lowest are near-ties, of
# which the fewest bits win. 0.5%: one codec's perplexity on the same 8 x 512 tokens moves by
# 0.01-0.70% (median 0.32%, five codecs) between kvq's C++ forward pass and transformers' (a
# rerun of either is bit for bit the same, whatever the thread count), so rows closer than that
# swap places when the arithmetic changes; a wider margin gives up test-text perplexity that
# the recorded rows show is real (docs/RESULTS.md, "Calibration chooses the codec").
NOISE_MARGIN = 0.005


def with_key_lever(name: str, lever: str) -> str:
    """`name` with the key lever applied (codec_search.cc WithKeyLever): headq names get it
    whole, kivi names its codec parts only (no basis to make oblique)."""
    if name.startswith("kivi") and lever.startswith("obl"):
        lever = lever.split("-", 1)[1] if "-" in lever else ""
    return f"{name}-{lever}" if lever else name


def with_sparse_lever(name: str) -> str:
    """`name` with the dense-and-sparse lever for the tensors it applies to (codec_search.cc
    WithSparseLever): keys unless rotated (rotk, rot), values unless rotated (rotv, rot)."""
    parts = name.split("-")
    out = name
    if "rotk" not in parts and "rot" not in parts:
        out += f"-sk{SPARSE_LEVER_PERMILLE}"
    if "rotv" not in parts and "rot" not in parts:
        out += f"-sv{SPARSE_LEVER_PERMILLE}"
    return out


def _suffix_int(part: str, prefix: str) -> Optional[int]:
    rest = part[len(prefix):]
    return int(rest) if part.startswith(prefix) and rest.isdigit() else None


def codec_of_name(name: str) -> Tuple[CodecSettings, bool]:
    """(the codec, whether it reads the oblique pair) of a kvq-eval config name of a full-KV
    codec a registry entry can hold (frontend/src/eval_config.cc's grammar and defaults:
    G = 32, value group 32, R = 0, side bits 8, rank 4 for headq; every field set, so the
    result does not depend on a model's defaults). Options: r, g, vg, v, w, s, mr, obl, rot,
    rotk, rotv, sink<N>, sk<N>, sv<N>. ValueError naming the config for anything else
    (k-only targets, a2, evaluation-only controls)."""
    parts = name.split("-")
    bits = _suffix_int(parts[1], "kv") if len(parts) >= 2 else None
    if len(parts) < 2 or parts[0] not in ("headq", "kivi") or bits is None:
        raise ValueError(f"config '{name}': expected headq-kv<bits>[-option...] or kivi-kv<bits>[-option...]")
    headq = parts[0] == "headq"
    c: Dict[str, Any] = dict(key_bits=bits, key_group=32, rank=4 if headq else 0, side_bits=8, value_bits=bits,
                             value_group=32, value_policy="uniform", value_budget=2.0, sink_tokens=4, window=0,
                             rotate_keys=False, rotate_values=False, metric_rounding=False, fp16_sinks=0,
                             sparse_keys=0, sparse_values=0)
    oblique = False
    for p in parts[2:]:
        if p == "mr":
            c["metric_rounding"] = True
        elif p == "obl" and headq:
            oblique = True
        elif p in ("rot", "rotk", "rotv"):
            c["rotate_keys"] = c["rotate_keys"] or p != "rotv"
            c["rotate_values"] = c["rotate_values"] or p != "rotk"
        else:
            # The order of eval_config.cc's prefixes: sk/sv/sink before s, vg before v.
            for prefix, key in (("sk", "sparse_keys"), ("sv", "sparse_values"), ("sink", "fp16_sinks"),
                                ("vg", "value_group"), ("v", "value_bits"), ("r", "rank"), ("g", "key_group"),
                                ("w", "window"), ("s", "side_bits")):
                v = _suffix_int(p, prefix)
                if v is not None and (prefix != "r" or headq):
                    c[key] = v
                    break
            else:
                raise ValueError(f"config '{name}': option '{p}' is not a codec setting a registry entry holds")
    return CodecSettings(**c), oblique


@dataclass
class CodecRow:
    """One candidate (codec_search.h CodecSearchRow)."""

    name: str
    settings: CodecSettings
    codec: Any  # kvq.codes.Codec at the model's head_dim
    k_bits: float
    v_bits: float
    sink_bits: float  # the fp16 sinks' rows, K and V together, at the search's window length
    oblique: bool = False
    skipped: str = ""  # why it was not evaluated ("" when it was)
    ppl: float = math.nan
    chosen: bool = False

    @property
    def bits(self) -> float:
        """Bits per element, K and V together, the sinks counted (CodecBits::per_element)."""
        return (self.k_bits + self.v_bits) / 2 + self.sink_bits


def choose_within(rows: Sequence[Any], budget: float, margin: float = NOISE_MARGIN) -> int:
    """The index of the chosen row among the evaluated ones (empty `skipped`, finite `ppl`) at
    <= budget bits (`bits`): of the near-ties, rows whose perplexity is at most (1 + margin)
    times the lowest, the one with the fewest bits, then the earlier row; -1 when none.
    kvq-calibrate's ChooseWithin applies the same rule (codec_search.h kChoiceNoiseMargin)."""
    fit = [i for i, r in enumerate(rows)
           if not r.skipped and math.isfinite(r.ppl) and r.bits <= budget]
    if not fit:
        return -1
    low = min(rows[i].ppl for i in fit)
    near = [i for i in fit if rows[i].ppl <= low * (1 + margin)]
    return min(near, key=lambda i: (rows[i].bits, i))


class _BitsModel:
    """A one-layer model of the real one's shape with a stand-in basis, for counting a codec's
    block bytes (they do not depend on the basis) before any basis exists."""

    def __init__(self, kv_heads: int, q_heads: int, head_dim: int, rank: int):
        eye = np.zeros((kv_heads, head_dim, rank), np.float32)
        eye[:, np.arange(rank), np.arange(rank)] = 1
        moment = np.broadcast_to(np.eye(head_dim, dtype=np.float32), (kv_heads, head_dim, head_dim))
        self.codes = model_codes("kvq-bits", 1, 1, kv_heads, q_heads, head_dim, rank, "0", [eye], [moment])
        self.rng = np.random.default_rng(0)

    def bits(self, codec: Any) -> Tuple[float, float]:
        G, D = codec.key_group, codec.head_dim
        kv = int(self.codes.info.kv_heads)
        x = self.rng.standard_normal((2, kv, G, D)).astype(np.float16)
        enc = self.codes.encode(0, x[0], x[1], codec)
        sizes = np.asarray(enc.block_bytes, dtype=np.int64).reshape(-1, 2)  # key, value per KV head
        return 8.0 * float(sizes[0, 0]) / (G * D), 8.0 * float(sizes[0, 1]) / (G * D)


def model_codes(name: str, version: int, layers: int, kv_heads: int, q_heads: int, head_dim: int, rank: int,
                fingerprint: str, u: Sequence[Any], moment: Sequence[Any], encode: Sequence[Any] = ()) -> Any:
    """kvq.codes.ModelCodes of a model of this shape with basis `u` (and its query moments and
    encode basis), in-process: what calibration encodes and decodes with before registering."""
    from ..codes import ModelCodes

    info = dict(model=name, version=version, layers=layers, kv_heads=kv_heads, q_heads=q_heads,
                head_dim=head_dim, basis_rank=rank, has_basis=rank > 0, fingerprint=fingerprint,
                has_query_moment=len(moment) > 0)
    return ModelCodes.from_basis(info, u, encode_basis=encode, query_moment=moment)


def plan_rows(names: Sequence[str], shape: Tuple[int, int, int], basis_rank: int, max_bits: float,
              context_tokens: int = 0, *, option: str = "bits") -> List[CodecRow]:
    """The rows of `names` for a model of shape (kv_heads, q_heads, head_dim) (codec_search.cc
    PlanCodecSearch): each parsed and checked at head_dim, its bits counted, skipped when over
    max_bits or its rank over basis_rank. CalibrationError naming `option` when none is left
    (naming the smallest candidate's bits)."""
    from ..errors import KvqError
    from .calibration import CalibrationError

    kv_heads, q_heads, head_dim = shape
    counter = _BitsModel(kv_heads, q_heads, head_dim, max(basis_rank, 1))
    rows: List[CodecRow] = []
    for name in names:
        settings, oblique = codec_of_name(name)
        if settings.rank is not None and settings.rank > max(basis_rank, 1):
            codec, kb, vb = None, math.nan, math.nan
        else:
            try:
                codec = counter.codes.codec(settings)
            except KvqError as e:
                raise CalibrationError(option, f"candidate '{name}' at head_dim {head_dim}: {e.details}") from None
            kb, vb = counter.bits(codec)
        sinks = 16.0 * (settings.fp16_sinks or 0) / context_tokens if context_tokens > 0 else 0.0
        row = CodecRow(name, settings, codec, kb, vb, sinks, oblique)
        if (settings.rank or 0) > basis_rank:
            row.skipped = f"rank {settings.rank} > basis rank {basis_rank}"
        elif row.bits > max_bits:
            row.skipped = f"{row.bits:.3f} bits > {max_bits:.3f}"
        rows.append(row)
    if not any(not r.skipped for r in rows):
        ranked = [r for r in rows if (r.settings.rank or 0) <= basis_rank]
        if not ranked:
            raise CalibrationError(option, "no codec candidate fits the basis rank")
        s = min(ranked, key=lambda r: r.bits)
        raise CalibrationError(option, f"{max_bits:.3f}: no codec candidate fits; the smallest, {s.name}, costs "
                                       f"{s.bits:.3f} bits per element (K {s.k_bits:.3f}, V {s.v_bits:.3f})")
    return rows


class _CodecLayer(CacheLayerMixin):
    """One layer of the evaluation cache: per window an encoder of kvq's codec, the decoded
    groups so far, and what attention sees after each append (decoded groups + fp16 rows)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, codes: Any, layer: int, codec: Any, batch: int):
        super().__init__()
        self.is_initialized = True
        self.codes, self.layer = codes, layer
        self.encoders = [codes.encoder(layer, codec) for _ in range(batch)]
        # Per window, its groups decoded so far: torch f32 [kv_heads, encoded tokens, head_dim].
        self.group_keys: List[Any] = [None] * batch
        self.group_values: List[Any] = [None] * batch
        self.seen = 0

    def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> Tuple[Any, Any]:
        """Appends the new rows ([batch, kv_heads, n, head_dim]) as fp16 and returns every row
        of each window as attention sees it: the decoded groups, then the fp16 rows."""

        def cat(a: Any, b: Any) -> Any:
            return b if a is None else torch.cat([a, b], dim=1)

        ks, vs = [], []
        k16 = key_states.detach().to(torch.float16).cpu().numpy()
        v16 = value_states.detach().to(torch.float16).cpu().numpy()
        for b, enc in enumerate(self.encoders):
            run = enc.append(k16[b], v16[b])
            dk, dv = (torch.from_numpy(np.asarray(a)) for a in self.codes.decode_encoded(run))
            new = run.groups * enc.codec.key_group  # the new groups' rows come first
            if new:
                self.group_keys[b] = cat(self.group_keys[b], dk[:, :new])
                self.group_values[b] = cat(self.group_values[b], dv[:, :new])
            ks.append(cat(self.group_keys[b], dk[:, new:]))
            vs.append(cat(self.group_values[b], dv[:, new:]))
        self.seen += int(key_states.shape[-2])
        dev, dt = key_states.device, key_states.dtype
        return torch.stack(ks).to(device=dev, dtype=dt), torch.stack(vs).to(device=dev, dtype=dt)

    def get_mask_sizes(self, query_length: int) -> Tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def lazy_initialization(self, key_states: Any, value_states: Any) -> None:
        self.is_initialized = True

    def reset(self) -> None:
        raise NotImplementedError("the codec evaluation cache is not reused")

    def offload(self) -> None:
        pass

    def prefetch(self) -> None:
        pass


class _CodecEvalCache(Cache):
    """A transformers Cache whose layers attend over K/V as kvq serves them (codec_perplexity)."""

    def __init__(self, codes: Any, codec: Any, layers: int, batch: int) -> None:
        self._codec_layers = [_CodecLayer(codes, i, codec, batch) for i in range(layers)]
        super().__init__(layers=cast(List[Any], self._codec_layers))

    def update(self, key_states: Any, value_states: Any, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
        return self._codec_layers[layer_idx].update(key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._codec_layers[layer_idx].seen


def codec_perplexity(lm: Any, codes: Any, codec: Any, tokens: Sequence[int], windows: int, window_len: int, *,
                     batch: int = 8, on_window: Optional[Callable[[int], None]] = None) -> float:
    """Perplexity of the transformers model `lm` with `codec` of `codes` (kvq.codes.ModelCodes)
    over `windows` consecutive windows of `window_len` tokens of `tokens`: llama.cpp's protocol
    (positions L/2 .. L-2 score the next token), decode-faithful (see the module docstring).
    Windows go `batch` at a time; on_window(windows done) reports progress."""
    from .cache import faithful_chunks

    if windows * window_len > len(tokens):
        raise ValueError(f"text has {len(tokens)} tokens, need {windows} x {window_len}")
    first = window_len // 2
    layers = int(codes.info.layers)
    device = next(lm.parameters()).device
    toks = torch.tensor(np.asarray(tokens[: windows * window_len], dtype=np.int64)).view(windows, window_len)
    nll = 0.0
    with torch.inference_mode():
        for w0 in range(0, windows, batch):
            nb = min(batch, windows - w0)
            cache = _CodecEvalCache(codes, codec, layers, nb)
            for pos, ln in faithful_chunks(0, window_len - 1, codec.key_group, codec.window):
                end = pos + ln
                keep = max(1, end - max(pos, first))
                x = toks[w0 : w0 + nb, pos:end].to(device)
                out = lm(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=keep)
                if end > first:
                    lp = torch.log_softmax(out.logits[:, -keep:].double(), dim=-1)
                    tgt = toks[w0 : w0 + nb, end - keep + 1 : end + 1].to(lp.device)
                    nll -= float(lp.gather(-1, tgt.unsqueeze(-1)).sum())
            if on_window:
                on_window(w0 + nb)
    return math.exp(nll / (windows * (window_len - 1 - first)))


def stored_prefix_perplexity(lm: Any, toks: Any, prefix: int, codes: Any = None, codec: Any = None, *,
                             batch: int = 8, on_window: Optional[Callable[[int], None]] = None) -> float:
    """The perplexity of the text after a stored prefix, as a serving engine that loads
    prefixes from kvq sees it (kvq.vllm, LMCache): for each window of `toks` (torch int64
    [windows, L]) its first `prefix` tokens computed exactly, every layer's K/V of them then
    encoded and decoded by `codec` of `codes` (kvq.codes.ModelCodes; None: kept dense), and the
    tokens prefix .. L-2 computed over that, their own K/V exact; their logits score tokens
    prefix + 1 .. L-1. Unlike codec_perplexity, the prefix's own forward never attends over
    codes. Windows go `batch` at a time; on_window(windows done) reports progress."""
    from transformers import DynamicCache

    windows, length = int(toks.shape[0]), int(toks.shape[1])
    if not 0 < prefix < length - 1:
        raise ValueError(f"prefix {prefix}: must leave tokens to score in windows of {length}")
    nll = 0.0
    with torch.inference_mode():
        for w0 in range(0, windows, batch):
            x = toks[w0:w0 + batch]
            cache = DynamicCache()
            lm(input_ids=x[:, :prefix], past_key_values=cache, use_cache=True, logits_to_keep=1)
            if codes is not None:
                coded = DynamicCache()
                for layer, held in enumerate(cache.layers):
                    keys, values = cast(Any, held).keys, cast(Any, held).values  # a dense layer's
                    ks, vs = [], []
                    for b in range(int(x.shape[0])):
                        run = codes.encoder(layer, codec).append(keys[b].to(torch.float16).numpy(),
                                                                 values[b].to(torch.float16).numpy())
                        dk, dv = codes.decode_encoded(run)
                        ks.append(torch.from_numpy(np.asarray(dk)))
                        vs.append(torch.from_numpy(np.asarray(dv)))
                    coded.update(torch.stack(ks).to(lm.dtype), torch.stack(vs).to(lm.dtype), layer)
                cache = coded
            out = lm(input_ids=x[:, prefix:length - 1], past_key_values=cache, use_cache=True)
            lp = torch.log_softmax(out.logits.double(), dim=-1)
            nll -= float(lp.gather(-1, x[:, prefix + 1:].unsqueeze(-1)).sum())
            if on_window:
                on_window(min(w0 + batch, windows))
    return math.exp(nll / (windows * (length - 1 - prefix)))


@dataclass
class CodecChoice:
    """What choose_codec chose and how (codec-search.json holds the same)."""

    chosen: CodecRow
    rows: List[CodecRow]  # stage 2's candidates
    budgets: List[Dict[str, Any]]  # per budget: max_bits_per_element, chosen, bits_per_element, ppl
    key_lever: str
    sink_lever: bool
    sparse_lever: bool
    stages: Dict[str, List[CodecRow]] = field(default_factory=dict)  # the lever stages' rows
    seconds: float = 0.0


def _row_json(r: CodecRow) -> Dict[str, Any]:
    row: Dict[str, Any] = {
        "name": r.name, "codec": str(r.codec) if r.codec is not None else None,
        "settings": r.codec.settings().__dict__ if r.codec is not None else None,
        "bits_per_element": r.bits, "k_bits": r.k_bits, "v_bits": r.v_bits, "sink_bits": r.sink_bits,
        "oblique_basis": r.oblique, "ppl": None if r.skipped else r.ppl, "chosen": r.chosen}
    if r.skipped:
        row["skipped"] = r.skipped
    return row


def _stage_json(rows: Sequence[CodecRow]) -> Dict[str, Any]:
    chosen = [r.name for r in rows if r.chosen]
    return {"candidates": [_row_json(r) for r in rows], "chosen": chosen[0] if chosen else None}


def codec_json(row: CodecRow) -> Dict[str, Any]:
    """codec.json of the chosen row: every setting (the registry's reader, core/codec_json.cc,
    takes them over its defaults; the names are CodecSettings', core/codec_schema.h's)."""
    return dict(row.codec.settings().__dict__)


def entry_codes(path: str) -> Any:
    """kvq.codes.ModelCodes of the registry entry at `path` (its basis, query moments and
    fingerprint as the server would register them)."""
    from .basis import read_basis

    files = read_basis(path)
    m = files.manifest
    return model_codes(m["model"], int(m["version"]), int(m["layers"]), int(m["kv_heads"]), int(m["q_heads"]),
                        int(m["head_dim"]), int(m["rank"]), str(m["fingerprint"]), files.u, files.query_moment,
                        files.encode)


def choose_codec(lm: Any, path: str, held_out: Sequence[int], budgets: Sequence[float], *, windows: int = 8,
                 window_len: int = 512, batch: int = 8, first_token: int = 0, text: str = "",
                 progress: bool = True) -> CodecChoice:
    """Chooses the codec for the entry at `path` (just calibrated for `lm`) within budgets[0]
    bits per element (the others chosen from the same rows), evaluating on the first windows x
    window_len tokens of `held_out` (the calibration text after the basis's tokens), and writes
    path/codec.json and path/codec-search.json. See the module docstring."""
    t0 = time.monotonic()
    codes = entry_codes(path)
    oblique_path = os.path.join(path, "oblique")
    oblique_codes = entry_codes(oblique_path) if os.path.isfile(os.path.join(oblique_path, "manifest.json")) else None
    info = codes.info
    shape = (int(info.kv_heads), int(info.q_heads), int(info.head_dim))
    rank = int(info.basis_rank)

    def search(names: Sequence[str], budget: float, what: str) -> Tuple[List[CodecRow], int]:
        rows = plan_rows(names, shape, rank, budget, window_len)
        todo = [r for r in rows if not r.skipped]
        print(f"kvq-calibrate-hf: {what}: {len(todo)} of {len(rows)} candidates, each on {windows} x {window_len} "
              f"tokens of {text or 'the text'} after its first {first_token}", file=sys.stderr)
        from .calibration import _progress

        bar = _progress(len(todo) * windows, progress, desc=f"kvq-calibrate-hf {what}", unit="window")
        try:
            for r in todo:
                if hasattr(bar, "set_postfix_str"):
                    bar.set_postfix_str(r.name)
                done = [0]

                def step(w: int, done: List[int] = done) -> None:
                    bar.update(w - done[0])
                    done[0] = w

                c = oblique_codes if r.oblique and oblique_codes is not None else codes
                r.ppl = codec_perplexity(lm, c, c.codec(r.settings), held_out, windows, window_len,
                                         batch=batch, on_window=step)
        finally:
            bar.close()
        chosen = choose_within(rows, math.inf)
        if chosen < 0:
            raise RuntimeError("no codec candidate gave a finite perplexity")
        rows[chosen].chosen = True
        print(_table(rows), file=sys.stderr)
        return rows, chosen

    # Stage 1: the key lever on the probe (the oblique lever only with an oblique pair, as
    # kvq-calibrate leaves it out when it has none).
    levers = [lv for lv in KEY_LEVERS if oblique_codes is not None or not lv.startswith("obl")]
    stage1, i1 = search([with_key_lever(LEVER_PROBE, lv) for lv in levers], math.inf, "key lever")
    lever = levers[i1]
    no_sinks = stage1[i1]
    # Stage 2: whether fp16 sinks pay on the probe with the lever.
    sink_rows, _ = search([f"{no_sinks.name}-{SINK_LEVER}"], math.inf, "sink lever")
    sinks = sink_rows[0].ppl < no_sinks.ppl
    so_far = sink_rows[0] if sinks else no_sinks
    # Stage 3: whether dense-and-sparse pays on the probe so far.
    sparse_rows, _ = search([with_sparse_lever(so_far.name)], math.inf, "dense-and-sparse lever")
    sparse = (sparse_rows[0].name != so_far.name
              and sparse_rows[0].ppl < so_far.ppl * (1 - SPARSE_LEVER_MIN_GAIN))
    # Stage 4: every candidate with the levers that paid, within the largest budget.
    names: List[str] = []
    for n in CANDIDATES:
        names.append(with_key_lever(n, lever))
        if sinks:
            names.append(f"{names[-1]}-{SINK_LEVER}")
        if sparse and with_sparse_lever(names[-1]) != names[-1]:
            names.append(with_sparse_lever(names[-1]))
    rows, _ = search(names, max(budgets), f"codec search (lever '{lever}')")
    per_budget = []
    for b in budgets:
        i = choose_within(rows, b)
        per_budget.append({"max_bits_per_element": b, "chosen": rows[i].name if i >= 0 else None,
                           "bits_per_element": rows[i].bits if i >= 0 else 0.0,
                           "ppl": rows[i].ppl if i >= 0 else None})
        if i >= 0:
            print(f"kvq-calibrate-hf: within {b:.3f} bits per element: {rows[i].name} ({rows[i].bits:.3f} bits, "
                  f"validation PPL {rows[i].ppl:.4f})", file=sys.stderr)
    first = choose_within(rows, budgets[0])
    if first < 0:
        from .calibration import CalibrationError

        raise CalibrationError("bits", f"{budgets[0]:.3f}: no evaluated candidate fits")
    for i, r in enumerate(rows):
        r.chosen = i == first
    best = rows[first]
    if best.oblique:
        # The entry serves with one basis: the oblique pair becomes DIR's, the query PCA moves
        # to DIR/query-pca (kvq-calibrate's layout).
        query_path = os.path.join(path, "query-pca")
        os.makedirs(query_path, exist_ok=True)
        for f in ("basis.safetensors", "manifest.json"):
            os.replace(os.path.join(path, f), os.path.join(query_path, f))
            shutil.copyfile(os.path.join(oblique_path, f), os.path.join(path, f))
    _write_json(os.path.join(path, "codec.json"), codec_json(best))
    search_json = {
        "max_bits_per_element": budgets[0],
        "criterion": "validation perplexity, llama.cpp's protocol (second half of each window), decode-faithful, "
                     "with the entry's basis (kvq's codec in-process, transformers' forward pass); near-ties "
                     f"(within {NOISE_MARGIN:g} of the lowest perplexity): fewer bits per element",
        "noise_margin": NOISE_MARGIN,
        "bits": "steady state, every byte counted: 8 * block bytes / (G * head_dim); per element = (K + V) / 2, "
                "plus the fp16 sinks' rows counted at window_len tokens (16 * sinks / window_len)",
        "text": text, "windows": windows, "window_len": window_len, "first_token": first_token,
        "candidates": [_row_json(r) for r in rows], "chosen": best.name, "budgets": per_budget,
        "key_lever": lever, "key_lever_search": _stage_json(stage1),
        "sink_lever": SINK_LEVER if sinks else "", "sink_lever_search": _stage_json(sink_rows),
        "sparse_lever": sparse, "sparse_lever_search": _stage_json(sparse_rows),
        "basis": "oblique_rrr (DIR; the query PCA in DIR/query-pca)" if best.oblique else "query PCA (DIR)",
    }
    _write_json(os.path.join(path, "codec-search.json"), search_json)
    return CodecChoice(best, rows, per_budget, lever, sinks, sparse,
                       {"key_lever": stage1, "sink_lever": sink_rows, "sparse_lever": sparse_rows},
                       time.monotonic() - t0)


def _write_json(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def _table(rows: Sequence[CodecRow]) -> str:
    out = [f"{'candidate':<28} {'bits':>7} {'k_bits':>7} {'v_bits':>7} {'PPL':>10}  codec"]
    for r in rows:
        ppl = "-" if r.skipped else f"{r.ppl:.4f}"
        mark = "  <- chosen" if r.chosen else (f"  (skipped: {r.skipped})" if r.skipped else "")
        out.append(f"{r.name:<28} {r.bits:7.3f} {r.k_bits:7.3f} {r.v_bits:7.3f} {ppl:>10}  {r.codec}{mark}")
    return "\n".join(out)


def main(argv: Optional[List[str]] = None) -> int:
    """python -m kvq.hf.codec_choice: the search's perplexity of named codecs on an entry's
    held-out windows (those the search uses), e.g. to measure run-to-run noise (run it twice,
    with other --threads) or to check a row of codec-search.json."""
    import argparse

    from .calibration import default_text, load_checkpoint, read_tokens

    ap = argparse.ArgumentParser(prog="python -m kvq.hf.codec_choice", description=main.__doc__)
    ap.add_argument("model", help="checkpoint folder, hub id, or .gguf file (as kvq-calibrate-hf's)")
    ap.add_argument("--entry", required=True, help="the entry kvq-calibrate-hf wrote (its basis)")
    ap.add_argument("--configs", required=True, help="comma-separated kvq-eval config names")
    ap.add_argument("--text", help="the calibration text (default: kvq-calibrate-hf's)")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--window-len", type=int, default=512)
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from .basis import read_basis

    codes = entry_codes(a.entry)
    first = int(read_basis(a.entry).manifest["calibration_tokens"])
    _, tokenizer, lm = load_checkpoint(a.model, None, "float32", "cpu")
    held = read_tokens(tokenizer, a.text or default_text(), first + a.windows * a.window_len)[first:]
    for name in a.configs.split(","):
        settings, _ = codec_of_name(name)
        t0 = time.monotonic()
        ppl = codec_perplexity(lm, codes, codes.codec(settings), held, a.windows, a.window_len)
        print(f"{name}: ppl {ppl:.6f} ({a.windows} x {a.window_len} tokens after the first {first}, "
              f"{torch.get_num_threads()} threads, {time.monotonic() - t0:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
