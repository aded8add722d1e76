"""HeadQ calibration of a transformers checkpoint: what kvq-calibrate fits for a GGUF model of
kvq's own frontend (frontend/tools/calibrate_main.cc), for any model transformers runs
and kvq serves (support.py).

The calibration text's first `tokens` tokens (the tokenizer's ids, no special tokens added:
the text is used verbatim, WikiText's <unk> markers kept as text, as kvq-calibrate does) are
cut into independent windows of `window_len` tokens, each starting at position 0 (the last
window may be shorter); full windows run `batch` at a time through the model's own forward
pass (no LM head, no KV cache). An attention function registered in transformers'
AttentionInterface sees each layer's post-RoPE queries [batch, q_heads, tokens, head_dim]
before it hands them to SDPA, and adds them to float64 sums per layer and KV head
(query_stats.py); no query is kept. The basis is the top-`rank` eigenvectors of each head's
uncentred E[q q^T], stored with E[q q^T] itself (the query moment the codec's metric rounding
needs), in the channel order transformers computes in: the manifest says channel_order "hf",
so that kvq.hf registers it unmapped and refuses to mix it with a GGUF-order basis.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import resource
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ..types import CodecSettings
from .basis import HF_CHANNEL_ORDER, _model_fields, write_basis
from .query_stats import QueryStats
from .support import check_supported, rope_layout

__all__ = ["CalibrationError", "CalibrationResult", "calibrate", "collect_query_stats", "load_checkpoint",
           "model_shape", "read_tokens", "default_model_name", "default_text"]

_CAPTURE = "kvq_calibrate_capture"
# The evaluation text: never calibrated on (its perplexity is what the results report).
_EVAL_TEXTS = ("wiki.test.raw", "wiki.test.tokens")


class CalibrationError(ValueError):
    """A bad argument or input: `field` is calibrate()'s argument at fault, the message says
    what it must be."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


@dataclass
class CalibrationResult:
    path: str  # the entry folder written (manifest.json + basis.safetensors)
    manifest: Dict[str, Any]
    captured_energy: np.ndarray  # [layers, kv_heads]: tr(U^T M U) / tr(M) on the calibration queries
    seconds: float  # the forward passes and the fit (not the model load)
    load_seconds: float
    peak_rss_bytes: int  # the process's peak resident memory so far
    registered: Any = None  # the server's ModelInfo when register= was given
    codec: Any = None  # codec_choice.CodecChoice when bits= was given (codec.json written)


def default_text() -> str:
    """$KVQ_DATA_DIR/wikitext-2/wiki.valid.tokens (KVQ_DATA_DIR default ../shared/data), the
    default of kvq-calibrate: the calibration split, never the evaluation text."""
    return os.path.join(os.environ.get("KVQ_DATA_DIR") or os.path.join("..", "shared", "data"),
                        "wikitext-2", "wiki.valid.tokens")


def default_model_name(model: str) -> str:
    """The checkpoint's file or folder name, lower case, without .gguf and a llama.cpp
    quantization tag (as kvq-calibrate names a GGUF), ending in "-hf" (the channel order: kvq.hf
    names transformers-order entries so, beside the GGUF-order entry of the same model):
    SmolLM2-135M-Instruct.Q4_1.gguf -> smollm2-135m-instruct-hf."""
    name = os.path.basename(os.path.normpath(model)).lower()
    if name.endswith(".gguf"):
        name = name[: -len(".gguf")]
    name = re.sub(r"[.-](i?q[0-9][a-z0-9_]*|f16|f32|bf16)$", "", name)
    return name if name.endswith("-" + HF_CHANNEL_ORDER) else f"{name}-{HF_CHANNEL_ORDER}"


def _split_checkpoint(model: str, gguf_file: Optional[str]) -> Tuple[str, Dict[str, Any]]:
    """(from_pretrained's path, its extra kwargs): a .gguf file is its folder + gguf_file."""
    if gguf_file is None and model.lower().endswith(".gguf"):
        if not os.path.isfile(model):
            raise CalibrationError("model", f"GGUF file {model} not found")
        return os.path.dirname(os.path.abspath(model)), {"gguf_file": os.path.basename(model)}
    if gguf_file is not None:
        return model, {"gguf_file": gguf_file}
    return model, {}


def read_tokens(tokenizer: Any, path: str, want: int) -> List[int]:
    """The first `want` token ids of the text file, tokenizing it a line-aligned chunk at a time
    (memory bounded by the chunk, whatever the file's size). Raises CalibrationError naming
    --text when the file is missing or too short."""
    ids: List[int] = []
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise CalibrationError("text", f"cannot read {path}: {e.strerror}") from None
    with f:
        rest = ""
        while len(ids) < want:
            chunk = f.read(1 << 18)
            if not chunk:
                if rest:
                    ids.extend(tokenizer(rest, add_special_tokens=False)["input_ids"])
                    rest = ""
                break
            chunk = rest + chunk
            cut = chunk.rfind("\n") + 1
            if cut == 0:
                rest = chunk
                continue
            rest = chunk[cut:]
            ids.extend(tokenizer(chunk[:cut], add_special_tokens=False)["input_ids"])
    if len(ids) < want:
        raise CalibrationError("text", f"{path} has {len(ids)} tokens, tokens = {want} were asked for")
    return ids[:want]


def _windows(n: int, window_len: int, batch: int) -> Iterator[Tuple[int, int, int]]:
    """(start, windows, length) per forward: `batch` full windows at a time, then the tail."""
    full = n // window_len
    for w in range(0, full, batch):
        yield w * window_len, min(batch, full - w), window_len
    if n % window_len:
        yield full * window_len, 1, n % window_len


def load_checkpoint(model: str, gguf_file: Optional[str], dtype: str, device: str) -> Tuple[Any, Any, Any]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path, extra = _split_checkpoint(model, gguf_file)
    try:
        config = AutoConfig.from_pretrained(path, **extra)
    except (OSError, ValueError) as e:
        raise CalibrationError("model", f"cannot load the config of {model}: {e}") from None
    config = config.get_text_config()  # the decoder's config (itself for a text-only model)
    check_supported(config)  # before the weights: a refused model costs nothing
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype) or not torch_dtype.is_floating_point:
        raise CalibrationError("dtype", f"'{dtype}' is not a torch floating-point dtype (e.g. float32, bfloat16)")
    tokenizer = AutoTokenizer.from_pretrained(path, **extra)
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, attn_implementation="sdpa", **extra)
    # transformers types .to through a decorator that mypy reads as unbound (self = device).
    lm.to(device)  # type: ignore[arg-type]
    lm.eval()
    return config, tokenizer, lm


def model_shape(config: Any) -> Tuple[int, int, int, int]:
    """(layers, q_heads, kv_heads, head_dim) of a transformers config: QueryStats' arguments."""
    f = _model_fields(config)
    return f["layers"], f["q_heads"], f["kv_heads"], f["head_dim"]


# The base code whose key residual the oblique pair is fitted to (kvq-calibrate's: 2-bit KIVI
# keys in groups of 32 tokens, no side code).
RESIDUAL_CODEC = CodecSettings(key_bits=2, key_group=32, rank=0, value_bits=2, value_group=32, window=0,
                               fp16_sinks=0, rotate_keys=False, rotate_values=False, metric_rounding=False,
                               sparse_keys=0, sparse_values=0)


class KeyResiduals:
    """Each window's key residuals against RESIDUAL_CODEC, encoded and decoded by kvq's own codec
    (kvq.codes, in-process), added to a QueryStats: for every whole group of 32 tokens from
    the window's start, as kvq-calibrate's hook does."""

    def __init__(self, stats: QueryStats):
        from .codec_choice import model_codes

        self.stats = stats
        self.codes = model_codes("kvq-residual", 1, stats.layers, stats.kv_heads, stats.q_heads,
                                  stats.head_dim, 0, "0", [], [])
        # The values go through the codec too (unused): a group within any head_dim.
        self.codec = self.codes.codec(dataclasses.replace(RESIDUAL_CODEC, value_group=min(32, stats.head_dim)))

    def add(self, layer: int, key: Any) -> None:
        """key: one attention call's post-RoPE keys [batch, kv_heads, tokens, head_dim]."""
        import torch

        G = int(RESIDUAL_CODEC.key_group or 0)
        n = int(key.shape[2]) // G * G
        if n == 0:
            return
        for k in key[:, :, :n].detach().to(device="cpu", dtype=torch.float32).numpy():
            decoded, _ = self.codes.decode_encoded(self.codes.encode(layer, k, k, self.codec))
            self.stats.add_residual(layer, k - decoded)


def collect_query_stats(lm: Any, ids: List[int], stats: QueryStats, *, window_len: int = 512,
                        batch: int = 4, progress: bool = False, residuals: bool = False) -> QueryStats:
    """Runs `ids` through the transformers model `lm` in independent windows of `window_len`
    tokens (`batch` full windows per forward pass, then the shorter tail alone), adding every
    layer's post-RoPE queries to `stats` from an attention function registered in
    transformers' AttentionInterface (it then attends with SDPA, so the forward is the model's
    own); with residuals=True also the keys' residuals the oblique pair needs (KeyResiduals).
    The model's attention implementation is restored afterwards. Returns `stats`."""
    import torch
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    keys = KeyResiduals(stats) if residuals else None

    def capture(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
        stats.add(int(module.layer_idx), query)
        if keys is not None:
            keys.add(int(module.layer_idx), key)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(_CAPTURE, capture)
    AttentionMaskInterface.register(_CAPTURE, sdpa_mask)
    before = lm.config._attn_implementation
    lm.set_attn_implementation(_CAPTURE)
    device = next(lm.parameters()).device
    bar = _progress(len(ids), progress)
    try:
        body = lm.base_model  # the decoder without the LM head: no [tokens, vocab] logits
        with torch.inference_mode():
            for start, n_win, length in _windows(len(ids), window_len, batch):
                x = torch.tensor(ids[start : start + n_win * length], dtype=torch.long, device=device)
                body(input_ids=x.view(n_win, length), use_cache=False)
                bar.update(n_win * length)
    finally:
        bar.close()
        lm.set_attn_implementation(before)
    return stats


def calibrate(
    model: str,
    *,
    out: Optional[str] = None,
    registry: Optional[str] = None,
    text: Optional[str] = None,
    tokens: int = 32768,
    rank: int = 8,
    window_len: int = 512,
    batch: int = 4,
    model_name: Optional[str] = None,
    version: int = 1,
    centred: bool = False,
    query_moment: bool = True,
    gguf_file: Optional[str] = None,
    device: str = "cpu",
    dtype: str = "float32",
    register: Optional[str] = None,
    progress: bool = True,
    bits: Optional[Sequence[float]] = None,
    search_windows: int = 8,
    search_window_len: int = 512,
    oblique: bool = False,
) -> CalibrationResult:
    """Calibrates `model` (a transformers checkpoint folder or hub id, or a .gguf file) and
    writes its registry entry: into `out` (the entry folder, as kvq-calibrate --out), or into
    `registry`/<model_name>/v<version> (a server's registry folder layout); exactly one of the
    two. Defaults are kvq-calibrate's (32768 tokens of wiki.valid.tokens in windows of 512,
    rank 8, query moments stored). `register`: a kvq-server address to register the entry with
    (kvq.hf.register_basis, after the codec is chosen: the entry's codec.json goes with it).
    `bits`: budgets in bits per element (K and V together, every byte counted): choose the
    codec for bits[0] as kvq-calibrate --bits does (codec_choice.py: the same candidates, lever
    stages and criterion), on `search_windows` windows of `search_window_len` tokens of the
    text that follow the calibration tokens, and write codec.json and codec-search.json into
    the entry (None: no codec is chosen; the server serves the entry with its default).
    centred=True fits the covariance instead (kind "query_pca_centred"). oblique=True (implied
    by bits) also fits the oblique pair into <entry>/oblique, as kvq-calibrate --bits does: the
    search tries it as a key lever, and the entry serves with it when it is chosen (the query
    PCA then moves to <entry>/query-pca). Raises
    CalibrationError (bad argument, naming it), UnsupportedModelError (a refused feature)."""
    if (out is None) == (registry is None):
        raise CalibrationError("out/registry", "exactly one is needed (the entry folder, or a registry folder)")
    for name, value, low in (("tokens", tokens, 1), ("rank", rank, 1), ("window_len", window_len, 1),
                             ("batch", batch, 1), ("version", version, 1), ("search_windows", search_windows, 1),
                             ("search_window_len", search_window_len, 4)):
        if int(value) < low:
            raise CalibrationError(name, f"{value}: must be >= {low}")
    budgets = [float(b) for b in bits] if bits is not None else []
    if budgets and not query_moment:
        raise CalibrationError("bits", "the codec search's metric-rounding levers need the query moments "
                               "(drop query_moment=False / --no-query-moment)")
    if bits is not None and (not budgets or not all(b > 0 and math.isfinite(b) for b in budgets)):
        raise CalibrationError("bits", f"{list(bits)}: must be positive numbers of bits per element")
    text = text or default_text()
    if os.path.basename(text) in _EVAL_TEXTS:
        raise CalibrationError("text", f"{text} is the evaluation text; calibrate on wiki.valid.tokens "
                               "(or other text the evaluation does not use)")
    if register:
        _check_serving(register)  # before the minutes of calibration, not after them
    t0 = time.monotonic()
    config, tokenizer, lm = load_checkpoint(model, gguf_file, dtype, device)
    layers, q_heads, kv_heads, head_dim = model_shape(config)
    if rank > head_dim:
        raise CalibrationError("rank", f"{rank}: must be <= head_dim = {head_dim}")
    name = model_name or default_model_name(model)
    if not 1 <= len(name) <= 128:
        raise CalibrationError("model_name", f"'{name}' must be 1..128 characters")
    if budgets:
        from .codec_choice import CANDIDATES, plan_rows

        # An impossible budget is an error now, not after the calibration.
        plan_rows(CANDIDATES, (kv_heads, q_heads, head_dim), rank, budgets[0])
    held = search_windows * search_window_len if budgets else 0
    try:
        ids = read_tokens(tokenizer, text, tokens + held)
    except CalibrationError as e:
        if not held:
            raise
        raise CalibrationError("search_windows", f"{e.message}: the basis's {tokens} calibration tokens + "
                               f"{search_windows} search windows x {search_window_len}") from None
    held_out, ids = ids[tokens:], ids[:tokens]
    load_seconds = time.monotonic() - t0

    t1 = time.monotonic()
    stats = QueryStats(layers, q_heads, kv_heads, head_dim)
    residuals = oblique or bool(budgets)
    collect_query_stats(lm, ids, stats, window_len=window_len, batch=batch, progress=progress,
                        residuals=residuals)
    fitted = stats.fit(rank, centred=centred)
    path = out if out is not None else os.path.join(str(registry), name, f"v{version}")

    def write(where: str, f: Any) -> Dict[str, Any]:
        return write_basis(where, {
            "model": name,
            "version": int(version),
            "q_heads": q_heads,
            "rope_layout": rope_layout(config),
            "channel_order": HF_CHANNEL_ORDER,
            "kind": f.kind,
            "calibration_tokens": f.calibration_tokens,
            "calibration_text": text,
        }, f.u, f.query_moment if query_moment else (), f.encode)

    manifest = write(path, fitted)
    if residuals:
        write(os.path.join(path, "oblique"), stats.fit_oblique(rank))
    energy = stats.captured_energy(fitted.u)
    seconds = time.monotonic() - t1
    chosen = None
    if budgets:
        from .codec_choice import choose_codec

        chosen = choose_codec(lm, path, held_out, budgets, windows=search_windows, window_len=search_window_len,
                              batch=batch, first_token=tokens, text=text, progress=progress)
    registered = None
    if register:
        registered = _register(register, path, config)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return CalibrationResult(path, manifest, energy, seconds, load_seconds, peak, registered, chosen)


def _check_serving(address: str) -> None:
    import grpc

    from ..client import Client
    from ..errors import KvqError

    with Client(address, deadline=5.0) as client:
        down = [server for server, serving in client.health(deadline=5.0) if not serving]
    if down:
        raise KvqError("Health", grpc.StatusCode.UNAVAILABLE,
                       f"kvq-server {', '.join(down)} is not SERVING (nothing was calibrated)")


def _register(address: str, path: str, config: Any) -> Any:
    from ..client import Client
    from .basis import register_basis

    with Client(address, deadline=30.0) as client:
        return register_basis(client, path, config=config, check=False)


class _Counter:
    """A stderr token counter for when tqdm is not importable (it comes with transformers)."""

    def __init__(self, total: int, desc: str = "kvq calibrate", unit: str = "tok"):
        self.total, self.done, self.last = total, 0, 0.0
        self.desc, self.unit = desc, unit

    def update(self, n: int) -> None:
        self.done += n
        if time.monotonic() - self.last > 1.0 or self.done >= self.total:
            self.last = time.monotonic()
            sys.stderr.write(f"\r{self.desc}: {self.done}/{self.total} {self.unit}")
            sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")


def _progress(total: int, enabled: bool, desc: str = "kvq calibrate", unit: str = "tok") -> Any:
    if not enabled:
        return _Null()
    try:
        from tqdm import tqdm
    except ImportError:
        return _Counter(total, desc, unit)
    return tqdm(total=total, unit=unit, desc=desc, file=sys.stderr, dynamic_ncols=True)


class _Null:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass
