"""kvq.hf: transformers (5.x) models attending through kvq.

    import kvq, kvq.hf
    client = kvq.Client("127.0.0.1:50051")
    info = kvq.hf.register_basis(client, "registry/smollm2/v1", model)  # rows in HF order
    kvq.hf.enable(model)                      # attn_implementation "kvq" + the ids hook
    with kvq.hf.KvqCache(client, info) as cache:
        out = model.generate(ids, **{kvq.hf.cache_kwarg(model): cache}, max_new_tokens=32)

Needs torch and transformers (imported here, not by the kvq client itself).
"""

from .attention import (
    ATTENTION_NAME,
    cache_kwarg,
    disable,
    enable,
    kvq_attention_forward,
    kvq_mask,
    register,
)
from .basis import (
    BasisFiles,
    BasisOrderError,
    basis_fingerprint,
    captured_query_energy,
    check_basis_order,
    hf_channel_order,
    read_basis,
    register_basis,
    register_model,
    to_model_order,
    write_basis,
)
from .cache import KvqCache, KvqCacheStats, generate_with_prefix

__all__ = [
    "ATTENTION_NAME",
    "BasisFiles",
    "BasisOrderError",
    "KvqCache",
    "cache_kwarg",
    "KvqCacheStats",
    "basis_fingerprint",
    "captured_query_energy",
    "check_basis_order",
    "disable",
    "enable",
    "generate_with_prefix",
    "hf_channel_order",
    "kvq_attention_forward",
    "kvq_mask",
    "read_basis",
    "register",
    "register_basis",
    "register_model",
    "to_model_order",
    "write_basis",
]
