"""Which transformers models kvq can serve, read from the config alone (no weights needed).

kvq stores post-RoPE keys per layer and KV head and attends with full causal attention over
every cached token, with the plain scaled dot product; a HeadQ basis is fitted per layer and
KV head. Models that attend otherwise are refused here, before any weight is loaded, with the
feature and the config field that shows it:

* sliding-window, chunked or linear-attention layers (`layer_types` other than
  "full_attention", or a `sliding_window` that is in use): kvq would attend to tokens the
  model never sees;
* attention logit soft-capping (`attn_logit_softcapping`): the server's scores are not capped;
* multi-head latent attention (`kv_lora_rank` / `q_lora_rank`): the cache holds a latent, not
  per-head keys;
* cross-layer KV sharing (`num_kv_shared_layers`): one layer's cache read by another;
* positions other than RoPE (no `rope_parameters`, ALiBi, or NoPE layers in `no_rope_layers`):
  the basis is fitted on, and the server stores, post-RoPE keys and queries;
* encoder-decoder models (`is_encoder_decoder`): cross-attention has no causal cache.

Partial rotary embeddings (`partial_rotary_factor` < 1: Phi, GPT-NeoX, StableLM) are allowed:
the server never applies RoPE itself, and the basis is fitted on the queries attention sees.
"""

from __future__ import annotations

from typing import Any, List

__all__ = ["UnsupportedModelError", "check_supported", "rope_layout", "unsupported_features"]

# transformers model types whose RoPE rotates adjacent channel pairs (rotate_every_two /
# interleaved rotate_half) rather than the two halves of the head; every other RoPE model in
# transformers rotates halves (rotate_half).
_ADJACENT_PAIRS = frozenset({"cohere", "cohere2", "gptj", "codegen", "glm", "glm4"})

_LAYER_TYPE_FEATURE = {
    "sliding_attention": "sliding-window attention",
    "chunked_attention": "chunked attention",
    "linear_attention": "linear-attention layers",
}


class UnsupportedModelError(ValueError):
    """A model with an attention feature kvq does not serve (the message names it)."""


def _get(config: Any, name: str) -> Any:
    return getattr(config, name, None)


def unsupported_features(config: Any) -> List[str]:
    """Each feature of `config` that kvq does not serve, as 'feature (field = value)'."""
    out: List[str] = []
    types = _get(config, "layer_types")
    if types:
        for t in sorted({str(t) for t in types} - {"full_attention"}):
            out.append(f"{_LAYER_TYPE_FEATURE.get(t, t)} (layer_types contains '{t}')")
    window = _get(config, "sliding_window")
    if window is not None and _get(config, "use_sliding_window") is not False and not (
            types and "sliding_attention" in types):
        out.append(f"sliding-window attention (sliding_window = {window})")
    cap = _get(config, "attn_logit_softcapping")
    if cap is not None:
        out.append(f"attention logit soft-capping (attn_logit_softcapping = {cap})")
    for field in ("kv_lora_rank", "q_lora_rank"):
        if _get(config, field) is not None:
            out.append(f"multi-head latent attention (MLA: {field} = {_get(config, field)})")
            break
    shared = _get(config, "num_kv_shared_layers")
    if shared:
        out.append(f"cross-layer KV sharing (num_kv_shared_layers = {shared})")
    if _get(config, "is_encoder_decoder"):
        out.append("encoder-decoder cross-attention (is_encoder_decoder = True)")
    attn_config = _get(config, "attn_config")  # MPT keeps alibi there (a dict or a config)
    alibi = _get(config, "alibi") or (
        attn_config.get("alibi") if isinstance(attn_config, dict) else _get(attn_config, "alibi"))
    if alibi:
        out.append("non-RoPE positions (ALiBi: alibi = True)")
    elif _get(config, "rope_parameters") is None and _get(config, "rope_theta") is None:
        out.append(f"non-RoPE positions (no rope_parameters in the config of model_type "
                   f"'{_get(config, 'model_type')}')")
    nope = _get(config, "no_rope_layers")
    if nope and not all(int(v) for v in nope):
        layers = [i for i, v in enumerate(nope) if not int(v)]
        out.append(f"non-RoPE positions (NoPE layers {layers[:8]}{'...' if len(layers) > 8 else ''} "
                   "in no_rope_layers)")
    return out


def check_supported(config: Any) -> None:
    """Raises UnsupportedModelError naming every feature kvq does not serve."""
    found = unsupported_features(config)
    if found:
        raise UnsupportedModelError(
            f"model_type '{_get(config, 'model_type')}' is not supported by kvq: "
            + "; ".join(found))


def rope_layout(config: Any) -> str:
    """The manifest's rope_layout of queries and keys as transformers computes them."""
    return "adjacent_pairs" if str(_get(config, "model_type")) in _ADJACENT_PAIRS else "halves"
