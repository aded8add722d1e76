"""HeadQ bases for transformers models: read kvq-calibrate's output, put its rows in the
channel order the transformers model computes in, register it.

kvq-calibrate fits each KV head's basis U [head_dim, rank] on post-RoPE queries in GGUF's
channel order with RoPE on adjacent pairs (manifest: channel_order "gguf", rope_layout
"adjacent_pairs"). transformers' GGUF loader un-permutes Llama's q/k weight rows into the
Hugging Face layout (RoPE on halves), so a Llama model in transformers produces keys whose
channel c = i * (head_dim / 2) + j is GGUF's channel 2 * j + i (i in {0, 1}). The scores
q . k are the same in either order, but a basis in the wrong order projects onto the wrong
channels: HeadQ's side code then corrects almost nothing and perplexity gets worse, with no
error anywhere. So the rows are mapped here, per head, and the entry is registered with
channel_order "hf" under its own name. Qwen2 GGUFs are not permuted (RoPE on halves in both),
so their rows stay as they are.

Files (core/src/codec/basis.cc): manifest.json, and basis.safetensors with one F32 tensor
"layer.{l}.u" [kv_heads, head_dim, rank] per layer; the fingerprint is the hex XXH3-64 of the
tensor bytes in layer order.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from ..errors import KvqError

__all__ = [
    "BasisFiles",
    "BasisOrderError",
    "read_basis",
    "write_basis",
    "basis_fingerprint",
    "hf_channel_order",
    "to_model_order",
    "register_basis",
    "register_model",
    "captured_query_energy",
    "check_basis_order",
    "HF_CHANNEL_ORDER",
]

# The channel_order kvq.hf registers: transformers' own layout of the model's q/k rows.
HF_CHANNEL_ORDER = "hf"

# model_type -> (GGUF q/k rows permuted relative to transformers?, rope layout transformers uses).
# Llama-family GGUFs are written by llama.cpp's converter with the rows permuted into adjacent
# pairs (transformers' LlamaTensorProcessor undoes it; "mistral" GGUFs say architecture
# "llama"); Qwen2's are not (its GGUF RoPE is NEOX-style, on halves, like transformers').
_GGUF_LAYOUT = {
    "llama": (True, "adjacent_pairs"),
    "mistral": (True, "adjacent_pairs"),
    "qwen2": (False, "halves"),
}


class BasisOrderError(ValueError):
    """A basis whose channel order does not match the model (or cannot be mapped to it)."""


@dataclass
class BasisFiles:
    """A registry entry as kvq-calibrate writes it."""

    manifest: Dict[str, Any]
    u: List[np.ndarray]  # per layer, f32 [kv_heads, head_dim, rank]
    codec: Optional[Dict[str, Any]] = None  # codec.json beside the manifest, if any
    # An oblique pair's encode basis A (u is then the decode basis B), per layer like u.
    encode: List[np.ndarray] = field(default_factory=list)
    # E[q q^T] per layer, f32 [kv_heads, head_dim, head_dim] (for codec metric_rounding).
    query_moment: List[np.ndarray] = field(default_factory=list)
    path: str = ""
    extra: Dict[str, Any] = field(default_factory=dict)


def _bad(path: str, what: str) -> KvqError:
    return KvqError.invalid("RegisterBasis", f"basis {path}: {what}")


def read_basis(path: str, *, verify_fingerprint: bool = True) -> BasisFiles:
    """Reads DIR/manifest.json and DIR/basis.safetensors (and DIR/codec.json if present),
    checking the fields, shapes and the fingerprint the way core::ReadBasis does."""
    mpath = os.path.join(path, "manifest.json")
    try:
        with open(mpath, "rb") as f:
            manifest = json.loads(f.read())
    except OSError as e:
        raise _bad(path, f"cannot read manifest.json: {e.strerror}") from None
    except ValueError as e:
        raise _bad(path, f"manifest.json is not JSON: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != "kvq-basis":
        raise _bad(path, "manifest format must be 'kvq-basis'")
    for k in ("model", "version", "layers", "kv_heads", "q_heads", "head_dim", "rank",
              "rope_layout", "fingerprint"):
        if k not in manifest:
            raise _bad(path, f"manifest field '{k}' missing")
    manifest.setdefault("channel_order", "gguf")
    L, H, D, R = (int(manifest[k]) for k in ("layers", "kv_heads", "head_dim", "rank"))
    if not (1 <= L <= 1024 and 1 <= H <= 1024 and 1 <= D <= 512 and 1 <= R <= D):
        raise _bad(path, f"manifest shape layers={L} kv_heads={H} head_dim={D} rank={R} out of range")
    tpath = os.path.join(path, "basis.safetensors")
    try:
        with open(tpath, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise _bad(path, f"cannot read basis.safetensors: {e.strerror}") from None
    if len(raw) < 8:
        raise _bad(path, "basis.safetensors truncated (no header length)")
    (hn,) = struct.unpack("<Q", raw[:8])
    if hn > len(raw) - 8:
        raise _bad(path, "basis.safetensors header length past the end of the file")
    try:
        header = json.loads(raw[8 : 8 + hn])
    except ValueError:
        raise _bad(path, "safetensors header is not JSON") from None
    data = raw[8 + hn :]
    per_layer = H * D * R * 4
    oblique = "layer.0.encode" in header
    has_moment = "layer.0.query_moment" in header
    want = per_layer * L * (2 if oblique else 1) + (H * D * D * 4 * L if has_moment else 0)
    if len(data) != want:
        raise _bad(path, f"tensor data is {len(data)} bytes, the manifest implies {want}")

    def tensors(suffix: str, cols: int, cols_name: str) -> List[np.ndarray]:
        out = []
        for layer in range(L):
            name = f"layer.{layer}.{suffix}"
            e = header.get(name)
            if e is None:
                raise _bad(path, f"tensor {name} missing")
            if e.get("dtype") != "F32" or list(e.get("shape", [])) != [H, D, cols]:
                raise _bad(path, f"{name}: must be F32 [kv_heads, head_dim, {cols_name}] = [{H}, {D}, {cols}]")
            b, end = (int(x) for x in e["data_offsets"])
            if end - b != H * D * cols * 4 or end > len(data):
                raise _bad(path, f"{name}: data_offsets out of range")
            out.append(np.frombuffer(data, dtype="<f4", count=H * D * cols, offset=b).reshape(H, D, cols).copy())
        return out

    u = tensors("u", R, "rank")
    encode = tensors("encode", R, "rank") if oblique else []
    moment = tensors("query_moment", D, "head_dim") if has_moment else []
    if verify_fingerprint:
        fp_hex = basis_fingerprint(u, encode, moment)
        if fp_hex != manifest["fingerprint"]:
            raise _bad(path, f"fingerprint {fp_hex} does not match the manifest's {manifest['fingerprint']}")
    codec = None
    cpath = os.path.join(path, "codec.json")
    if os.path.exists(cpath):
        with open(cpath, "rb") as f:
            codec = json.loads(f.read())
    return BasisFiles(manifest=manifest, u=u, codec=codec, path=path, encode=encode,
                      query_moment=moment)


def basis_fingerprint(u: Sequence[np.ndarray], encode: Sequence[np.ndarray] = (),
                      query_moment: Sequence[np.ndarray] = ()) -> str:
    """core::BasisFingerprint: hex XXH3-64 of U's f32 bytes in layer order, chained (as the
    seed) through A's and then the query moments' bytes when present."""
    import xxhash

    fp = xxhash.xxh3_64_intdigest(b"".join(np.ascontiguousarray(x, dtype="<f4").tobytes() for x in u))
    for extra in (encode, query_moment):
        if len(extra):
            data = b"".join(np.ascontiguousarray(x, dtype="<f4").tobytes() for x in extra)
            fp = xxhash.xxh3_64_intdigest(data, seed=fp)
    return f"{fp:016x}"


# manifest.json's fields in the order core::WriteBasis lists them (nlohmann's json writes
# them sorted by name, as json.dumps(sort_keys=True) does).
_MANIFEST_FIELDS = ("format", "format_version", "model", "version", "layers", "kv_heads", "q_heads",
                    "head_dim", "rank", "rope_layout", "channel_order", "kind", "calibration_tokens",
                    "calibration_text", "fingerprint")


def write_basis(path: str, manifest: Dict[str, Any], u: Sequence[np.ndarray],
                query_moment: Sequence[np.ndarray] = (), encode: Sequence[np.ndarray] = ()) -> Dict[str, Any]:
    """Writes a registry entry folder as core::WriteBasis does: basis.safetensors (F32
    "layer.{l}.u" [kv_heads, head_dim, rank], an oblique pair's encode basis "layer.{l}.encode"
    of the same shape when given, then "layer.{l}.query_moment" [kv_heads, head_dim, head_dim]
    when given; metadata format "kvq-basis" and the fingerprint) and
    manifest.json (every field of core's manifest, format_version 1: no value metrics), each
    through a temporary file and a rename. `manifest` gives model, version, rope_layout,
    channel_order, kind, calibration_tokens and calibration_text; the shape fields and the
    fingerprint are taken from the tensors. Returns the manifest written. The result is
    read back with read_basis (every check core::ReadBasis makes of it)."""
    from safetensors.numpy import save_file

    if not len(u):
        raise ValueError("write_basis: no layers")
    H, D, R = (int(v) for v in u[0].shape)
    if query_moment and len(query_moment) != len(u):
        raise ValueError(f"write_basis: {len(query_moment)} query moments for {len(u)} layers")
    if encode and len(encode) != len(u):
        raise ValueError(f"write_basis: {len(encode)} encode bases for {len(u)} layers")
    for name, xs in (("u", u), ("encode", encode)):
        for layer, x in enumerate(xs):
            if tuple(x.shape) != (H, D, R):
                raise ValueError(f"write_basis: layer.{layer}.{name} has shape {tuple(x.shape)}, "
                                 f"layer.0.u {(H, D, R)}")
    for layer, x in enumerate(query_moment):
        if tuple(x.shape) != (H, D, D):
            raise ValueError(f"write_basis: layer.{layer}.query_moment has shape {tuple(x.shape)}, "
                             f"want [kv_heads, head_dim, head_dim] = {(H, D, D)}")
    u32 = [np.ascontiguousarray(x, dtype="<f4") for x in u]
    qm32 = [np.ascontiguousarray(x, dtype="<f4") for x in query_moment]
    a32 = [np.ascontiguousarray(x, dtype="<f4") for x in encode]
    fp = basis_fingerprint(u32, a32, qm32)
    full = dict(manifest, format="kvq-basis", format_version=1, layers=len(u), kv_heads=H,
                head_dim=D, rank=R, fingerprint=fp)
    missing = [k for k in _MANIFEST_FIELDS if k not in full]
    if missing:
        raise ValueError(f"write_basis: manifest field(s) {missing} missing")
    full = {k: full[k] for k in _MANIFEST_FIELDS}
    tensors = {f"layer.{layer}.u": x for layer, x in enumerate(u32)}
    tensors.update({f"layer.{layer}.encode": x for layer, x in enumerate(a32)})
    tensors.update({f"layer.{layer}.query_moment": x for layer, x in enumerate(qm32)})
    os.makedirs(path, exist_ok=True)
    tmp = os.path.join(path, f".basis.safetensors.tmp{os.getpid()}")
    save_file(tensors, tmp, metadata={"format": "kvq-basis", "fingerprint": fp})
    os.replace(tmp, os.path.join(path, "basis.safetensors"))
    tmp = os.path.join(path, f".manifest.json.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(json.dumps(full, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    os.replace(tmp, os.path.join(path, "manifest.json"))
    return full


def hf_channel_order(head_dim: int) -> np.ndarray:
    """perm with perm[c] = the GGUF channel of transformers' channel c, for one Llama head:
    transformers' rows (half i, index j) are GGUF's rows (pair j, element i)."""
    if head_dim % 2:
        raise BasisOrderError(f"head_dim {head_dim} is odd: no RoPE pair layout")
    half = head_dim // 2
    c = np.arange(head_dim)
    i, j = c // half, c % half
    return 2 * j + i


def _model_fields(config: Any) -> Dict[str, int]:
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    hd = getattr(config, "head_dim", None) or config.hidden_size // heads
    return {"layers": int(config.num_hidden_layers), "kv_heads": kv, "q_heads": heads,
            "head_dim": int(hd)}


def to_model_order(basis: BasisFiles, config: Any) -> BasisFiles:
    """The basis with its rows in the order a transformers model of `config` computes in
    (channel_order "hf"), checking the shape against the model. Raises BasisOrderError when
    the recorded order cannot be mapped (unknown order, a layout that contradicts the
    model's GGUF architecture, or a model type whose GGUF layout kvq.hf does not know)."""
    m = basis.manifest
    want = _model_fields(config)
    for k, v in want.items():
        if int(m[k]) != v:
            raise BasisOrderError(
                f"basis {basis.path}: {k} = {m[k]} but the model has {k} = {v} "
                f"(model_type {getattr(config, 'model_type', '?')})")
    order, rope = str(m.get("channel_order", "gguf")), str(m["rope_layout"])
    if order == HF_CHANNEL_ORDER:
        from .support import rope_layout

        want_rope = rope_layout(config)
        if rope != want_rope:
            raise BasisOrderError(
                f"basis {basis.path}: channel_order 'hf' with rope_layout '{rope}': transformers "
                f"applies RoPE on {want_rope} for model_type '{getattr(config, 'model_type', '?')}'")
        return basis
    if order != "gguf":
        raise BasisOrderError(
            f"basis {basis.path}: channel_order '{order}' is not 'gguf' or 'hf'; kvq.hf cannot "
            "map it to the model's layout")
    mt = str(getattr(config, "model_type", ""))
    if mt not in _GGUF_LAYOUT:
        raise BasisOrderError(
            f"basis {basis.path}: channel_order 'gguf' for model_type '{mt}': kvq.hf knows the "
            f"GGUF q/k layout of {sorted(_GGUF_LAYOUT)} only; register a basis fitted in "
            "transformers' order (channel_order 'hf') instead")
    permuted, gguf_rope = _GGUF_LAYOUT[mt]
    if rope != gguf_rope:
        raise BasisOrderError(
            f"basis {basis.path}: rope_layout '{rope}' with channel_order 'gguf', but {mt} GGUFs "
            f"apply RoPE on {gguf_rope}: the basis was not fitted on this kind of model")
    u, encode, moment = basis.u, basis.encode, basis.query_moment
    if permuted:
        # Rows of U and A are channels; a query moment's rows and columns both are.
        perm = hf_channel_order(int(m["head_dim"]))
        u = [np.ascontiguousarray(x[:, perm, :]) for x in u]
        encode = [np.ascontiguousarray(x[:, perm, :]) for x in encode]
        moment = [np.ascontiguousarray(x[:, perm, :][:, :, perm]) for x in moment]
    out = replace(basis, u=u, encode=encode, query_moment=moment,
                  manifest=dict(m, channel_order=HF_CHANNEL_ORDER, rope_layout="halves"))
    return out


def captured_query_energy(model: Any, u: Sequence[np.ndarray], input_ids: Any) -> float:
    """Mean over layers and KV heads of |U^T q|^2 / |q|^2 for the post-RoPE queries of a
    forward pass of `model` over `input_ids` (the query heads of a group pooled), with U in
    the rows given. A basis in the model's order captures most of the query energy (that is
    what it was fitted for); the same basis in another order captures about rank/head_dim."""
    import torch
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    captured: Dict[int, Any] = {}

    def capture(module, query, key, value, attention_mask, **kwargs):
        captured[module.layer_idx] = query.detach().float()
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("kvq_capture_queries", capture)
    AttentionMaskInterface.register("kvq_capture_queries", sdpa_mask)
    before = model.config._attn_implementation
    model.set_attn_implementation("kvq_capture_queries")
    try:
        with torch.no_grad():
            model(input_ids=input_ids, use_cache=False)
    finally:
        model.set_attn_implementation(before)
    fracs = []
    for layer, q in captured.items():  # q [B, q_heads, n, D]
        kvh = u[layer].shape[0]
        g = q.shape[1] // kvh
        for h in range(kvh):
            qs = q[:, h * g : (h + 1) * g].reshape(-1, q.shape[-1]).numpy()
            proj = qs @ u[layer][h]
            fracs.append(float((proj**2).sum() / max((qs**2).sum(), 1e-30)))
    return float(np.mean(fracs))


def _probe_ids(config: Any, n: int = 96) -> Any:
    import torch

    # Deterministic, varied ids: the check needs realistic query directions per head, which
    # any text gives (queries' dominant channels are a property of the weights and RoPE).
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, int(config.vocab_size), (1, n), generator=g)


def check_basis_order(model: Any, basis: BasisFiles, input_ids: Any = None) -> Dict[str, float]:
    """Measures the query energy the mapped basis captures against the same rows in GGUF
    order; raises BasisOrderError when the other order captures more (the manifest's
    channel_order is wrong). Returns both fractions."""
    if input_ids is None:
        input_ids = _probe_ids(model.config)
    mt = str(getattr(model.config, "model_type", ""))
    permuted = _GGUF_LAYOUT.get(mt, (False, ""))[0]
    ours = captured_query_energy(model, basis.u, input_ids)
    out = {"captured": ours}
    if permuted:
        d = int(basis.manifest["head_dim"])
        inv = np.argsort(hf_channel_order(d))
        # The alternative: the rows read the other way round (what a wrong manifest gives).
        alt_u = [np.ascontiguousarray(x[:, inv, :]) for x in basis.u]
        alt_u2 = [np.ascontiguousarray(x[:, hf_channel_order(d), :]) for x in basis.u]
        alt = max(captured_query_energy(model, alt_u, input_ids),
                  captured_query_energy(model, alt_u2, input_ids))
        out["captured_other_order"] = alt
        if alt > ours:
            raise BasisOrderError(
                f"basis {basis.path}: in the order its manifest implies (channel_order "
                f"'{basis.extra.get('source_channel_order', '?')}') it captures {ours:.1%} of the "
                f"model's query energy, permuted {alt:.1%}: the recorded channel order is wrong")
    return out


def _info(basis: BasisFiles, name: str, with_basis: bool) -> Dict[str, Any]:
    m = basis.manifest
    info: Dict[str, Any] = {
        "model": name,
        "version": int(m["version"]),
        "layers": int(m["layers"]),
        "kv_heads": int(m["kv_heads"]),
        "q_heads": int(m["q_heads"]),
        "head_dim": int(m["head_dim"]),
        "basis_rank": int(m["rank"]) if with_basis else 0,
        "has_basis": with_basis,
        "rope_layout": str(m["rope_layout"]),
        "channel_order": str(m["channel_order"]),
        "kind": str(m.get("kind", "query_pca_uncentred")),
        "calibration_tokens": int(m.get("calibration_tokens", 0)),
    }
    if basis.codec:
        from ..types import CodecSettings

        info["codec"] = CodecSettings.from_codec_json(basis.codec)
    return info


def register_basis(
    client: Any,
    path: str,
    model: Any = None,
    *,
    config: Any = None,
    name: Optional[str] = None,
    check: bool = True,
    probe_ids: Any = None,
) -> Any:
    """Registers kvq-calibrate's output DIR for a transformers model, in one call.

    The basis rows are mapped into the order the model computes in (see to_model_order) and
    registered with channel_order "hf" under `name` (default: a basis mapped from GGUF order
    gets the manifest's model name + "-hf", so that it never collides with the GGUF-order
    entry that kvq-eval or the C++ frontend register under the plain name; a basis already in
    transformers' order, as kvq.calibrate writes it, keeps its manifest's name). With `model`
    given and check=True, a forward pass over `probe_ids` (default 96 fixed pseudo-random ids)
    confirms that the mapped basis captures more of the model's query energy than the other
    order would, and raises BasisOrderError otherwise. Returns the server's ModelInfo (pb) of the entry."""
    if model is None and config is None:
        raise KvqError.invalid("RegisterBasis", "model/config: one is needed to know the channel order")
    cfg = config if config is not None else model.config
    files = read_basis(path)
    source = files.manifest.get("channel_order", "gguf")
    mapped = to_model_order(files, cfg)
    mapped.extra["source_channel_order"] = source
    if check and model is not None:
        check_basis_order(model, mapped, probe_ids)
    entry = name or (files.manifest["model"] if source == HF_CHANNEL_ORDER
                     else f"{files.manifest['model']}-{HF_CHANNEL_ORDER}")
    resp = client.register_basis(_info(mapped, entry, True), mapped.u,
                                 encode_basis=mapped.encode, query_moment=mapped.query_moment)
    return resp.model


def register_model(client: Any, config: Any, name: str, *, version: int = 1, codec: Any = None) -> Any:
    """Registers a model without a basis (HeadQ off: the KIVI-like base code only), shaped
    after a transformers config. Returns the server's ModelInfo (pb)."""
    f = _model_fields(config)
    info: Dict[str, Any] = dict(model=name, version=version, basis_rank=0, has_basis=False,
                                rope_layout="halves", channel_order=HF_CHANNEL_ORDER, kind="none", **f)
    if codec is not None:
        info["codec"] = codec
    return client.register_basis(info).model
