"""The "kvq" attention implementation for transformers 5.x.

transformers' attention modules call `past_key_values.update(k, v, layer)` and then the
function registered under `config._attn_implementation` with (module, query, key, value,
attention_mask, scaling, dropout, **kwargs). With attn_implementation "kvq":

* KvqCache.update keeps nothing: it hands the new tokens' K/V to this thread's pending slot
  and returns them unchanged;
* kvq_attention_forward takes them from that slot and lets the cache send one Attend per
  layer for the whole batch: each sequence's new K/V ride in its item as the append, its
  queries attend with causal_offset = the tokens the server held before (so prefill queries
  are causal and decode queries see everything), with the module's own `scaling`;
* kvq_mask (the matching AttentionMaskInterface entry) builds no dense [q, kv] mask: it
  passes on only the 2-D padding mask (or None), from which the cache drops padded rows
  before sending.

A forward pre-hook (installed by `enable`) gives the cache each forward's input_ids, the
token ids that travel with appends for prefix sharing.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

__all__ = ["ATTENTION_NAME", "enable", "disable", "kvq_attention_forward", "kvq_mask", "register"]

ATTENTION_NAME = "kvq"

# update() -> attention function hand-off, per thread (a forward runs on one thread; the
# attention function runs right after its layer's update()).
_pending = threading.local()


def set_pending(cache: Any, layer: int, key: Any, value: Any) -> None:
    _pending.item = (cache, layer, key, value)


def kvq_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    item = getattr(_pending, "item", None)
    _pending.item = None
    if item is None or item[2] is not key:
        raise RuntimeError(
            "kvq attention: no KvqCache update for this layer; attn_implementation 'kvq' runs "
            "only with a kvq.hf.KvqCache as past_key_values (and use_cache=True)")
    cache, layer, _, _ = item
    own = getattr(module, "layer_idx", layer)
    if own != layer:
        raise RuntimeError(f"kvq attention: module of layer {own} got the update of layer {layer}")
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError("kvq attention: sliding-window layers are not supported")
    if kwargs.get("softcap") is not None or getattr(module, "attn_logit_softcapping", None):
        raise NotImplementedError("kvq attention: logit soft-capping is not supported")
    if dropout and getattr(module, "training", False):
        raise NotImplementedError("kvq attention: inference only (dropout > 0 in training mode)")
    if scaling is None:
        scaling = getattr(module, "scaling", 0.0) or 0.0
    out = cache.attend_layer(layer, query, key, value, float(scaling), attention_mask)
    return out, None


def kvq_mask(*, batch_size, q_length, kv_length, attention_mask=None, mask_function=None, **kwargs) -> Optional[Any]:
    """The padding mask only ([batch, kv_length] bool), or None without padding: the server
    applies causality itself (AttendItem.causal_offset)."""
    from transformers.masking_utils import causal_mask_function

    if mask_function is not None and mask_function is not causal_mask_function:
        raise NotImplementedError(
            "kvq attention: only the plain causal mask is supported (this model composes "
            "another mask function with it)")
    if attention_mask is None:
        return None
    m = attention_mask[:, -kv_length:] if attention_mask.shape[-1] >= kv_length else attention_mask
    return None if bool(m.all()) else m.bool()


def register() -> None:
    """Registers "kvq" in transformers' AttentionInterface and AttentionMaskInterface."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, kvq_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, kvq_mask)


def cache_kwarg(model: Any) -> str:
    """The name under which `model`'s forward (and so generate) takes its cache: "cache" from
    transformers 5.25 on, "past_key_values" before (5.25 still takes the old name, with a
    deprecation warning, until 5.40)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _capture_ids(module, args, kwargs):
    from .cache import KvqCache

    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if isinstance(cache, KvqCache):
        ids = kwargs.get("input_ids")
        if ids is None and args:
            ids = args[0]
        cache.note_input_ids(ids)
    return None


def enable(model: Any) -> Any:
    """Makes `model` attend through kvq: registers the implementation, switches the model
    to it and installs the pre-hook that gives a KvqCache the forward's token ids. Returns
    the model. `disable(model)` switches back (to sdpa by default)."""
    register()
    model.set_attn_implementation(ATTENTION_NAME)
    if not getattr(model, "_kvq_ids_hook", None):
        model._kvq_ids_hook = model.register_forward_pre_hook(_capture_ids, with_kwargs=True)
    return model


def disable(model: Any, attn_implementation: str = "sdpa") -> Any:
    model.set_attn_implementation(attn_implementation)
    return model
