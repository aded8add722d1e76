"""kvq.vllm's settings, read from vLLM's kv_connector_extra_config.

Every key, its default and why (client/python/README.md "kvq behind vLLM" lists them too):
  address          kvq server(s): "host:port", a comma-separated list (sharded by the
                   client's ring) or a routing proxy with router=true. Required.
  model            the kvq model name the engine's model is registered under. Required.
  tenant, token    who stores (token: bearer auth; tenant: x-kvq-tenant without auth).
  allow_insecure_token  a token over plaintext (loopback tests only).
  router           address is a routing proxy (deploy/haproxy).
  codec            dict of kvq.CodecSettings fields for the sequences this engine creates
                   (None: the model's defaults). Part of the sequence names: engines with
                   other settings never read each other's K/V.
  deadline_s       seconds per kvq call attempt (default 10): saves and loads.
  lookup_deadline_s  seconds for the scheduler's prefix lookup (default 2): a slower kvq
                   answers "no hit" rather than holding the scheduler.
  load_deadline_s  seconds a hit's load may take (default 5): past it the load stops and its
                   blocks are reported as failed loads, which vLLM recomputes under
                   kv_load_failure_policy="recompute" (the request never fails or waits longer).
  overlap_loads    True (default): a hit's load runs on a thread while the forward pass
                   computes, each attention layer waiting for its own layer only
                   (wait_for_layer_load). False: the load completes in start_load_kv, before
                   the forward pass. On a CPU engine both share the cores (vLLM's OpenMP
                   threads slow down while the load runs beside them), yet overlapping was
                   still faster on 2 cores: an 8k-token SmolLM2 hit 0.24-0.29 s against
                   0.31-0.41 s (docs/BENCHMARKS.md).
  save_buffer_mb   0 (default): a step's saves finish inside the step (wait_for_save), so a
                   prompt is in kvq when its request's step ends. > 0: the step hands its saves
                   (copies of the K/V) to a background thread and goes on; saves past this many
                   MiB of pending K/V are dropped and counted (kvq.vllm.save_queue), so a slow
                   or stopped kvq costs the engine at most this memory and never a step.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Dict, Mapping, Optional

__all__ = ["KvqConnectorConfig"]


@dataclass(frozen=True)
class KvqConnectorConfig:
    address: str
    model: str
    tenant: Optional[str] = None
    token: Optional[str] = None
    allow_insecure_token: bool = False
    router: bool = False
    codec: Optional[Dict[str, Any]] = None
    deadline_s: float = 10.0
    lookup_deadline_s: float = 2.0
    load_deadline_s: float = 5.0
    save_buffer_mb: float = 0.0
    overlap_loads: bool = True

    @classmethod
    def from_extra(cls, extra: Optional[Mapping[str, Any]]) -> KvqConnectorConfig:
        """Checks and reads kv_connector_extra_config; a bad key or value is a ValueError
        naming it."""
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown key(s) {', '.join(unknown)} "
                             f"(kvq.vllm knows {', '.join(sorted(known))})")
        for key in ("address", "model"):
            if not isinstance(extra.get(key), str) or not extra[key]:
                raise ValueError(f"kv_connector_extra_config.{key}: required, a non-empty string")
        for key in ("deadline_s", "lookup_deadline_s", "load_deadline_s"):
            if key in extra and not (isinstance(extra[key], (int, float)) and extra[key] > 0):
                raise ValueError(f"kv_connector_extra_config.{key}: must be a number > 0, got {extra[key]!r}")
        if "save_buffer_mb" in extra and not (isinstance(extra["save_buffer_mb"], (int, float))
                                              and extra["save_buffer_mb"] >= 0):
            raise ValueError(f"kv_connector_extra_config.save_buffer_mb: must be a number >= 0, "
                             f"got {extra['save_buffer_mb']!r}")
        for key in ("allow_insecure_token", "router", "overlap_loads"):
            if key in extra and not isinstance(extra[key], bool):
                raise ValueError(f"kv_connector_extra_config.{key}: must be true or false, got {extra[key]!r}")
        if extra.get("codec") is not None and not isinstance(extra["codec"], dict):
            raise ValueError("kv_connector_extra_config.codec: must be a dict of kvq.CodecSettings fields")
        return cls(**extra)
