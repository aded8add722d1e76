"""Request building and response decoding of the kvq clients (kvq.Client, kvq.aio.Client).

Pure functions over the generated messages: each checks its arguments client-side (errors are
KvqError INVALID_ARGUMENT naming the field, raised before anything is sent), builds the
request, or decodes and merges what the servers sent back. No I/O here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Type, TypeVar, Union

import grpc
import numpy as np

from ._proto.kvq.v1 import kvq_pb2
from .errors import KvqError, code_from_int
from .tensors import dtype_enum, from_tensor, to_tensor
from .types import (
    AnyAppend,
    Append,
    AttendItem,
    Block,
    CodecSettings,
    ItemResult,
    ReadoutItem,
    ScoreItem,
)

_Item = TypeVar("_Item")

_POLICIES = {
    "uniform": kvq_pb2.CodecSettings.VALUE_POLICY_UNIFORM,
    "a2": kvq_pb2.CodecSettings.VALUE_POLICY_A2,
}


def _codec_pb(c: Optional[CodecSettings], field: str, method: str) -> Optional[kvq_pb2.CodecSettings]:
    """The wire form of codec settings: the fields that are not None, each sent as it is (the
    server checks ranges and names the field); a kvq_pb2.CodecSettings is sent as it is."""
    if c is None:
        return None
    if isinstance(c, kvq_pb2.CodecSettings):
        return c
    if isinstance(c, Mapping):
        c = CodecSettings(**c)
    values: Dict[str, Any] = {
        f.name: getattr(c, f.name) for f in dataclasses.fields(CodecSettings) if getattr(c, f.name) is not None
    }
    if "value_policy" in values:
        policy = _POLICIES.get(str(values["value_policy"]).lower())
        if policy is None:
            raise KvqError.invalid(method, f"{field}.value_policy: {values['value_policy']!r} is not uniform or a2")
        values["value_policy"] = policy
    for name in ("rotate_keys", "rotate_values", "metric_rounding"):
        if name in values and not isinstance(values[name], bool):
            raise KvqError.invalid(method, f"{field}.{name}: {values[name]!r} must be True or False")
    return kvq_pb2.CodecSettings(**values)


def append_pb(a: AnyAppend, field: str, method: str,
              out: Optional[kvq_pb2.Append] = None) -> kvq_pb2.Append:
    """kvq_pb2.Append for an Append (checks shapes client-side; field names it in errors).
    A kvq_pb2.Append (built by kvq.codes: codes on the wire) is taken as it is; the server
    checks it. out: fill this message (a field of the request being built) instead of a new
    one."""
    if isinstance(a, kvq_pb2.Append):
        if not a.sequence_id:
            raise KvqError.invalid(method, f"{field}.sequence_id: empty")
        if out is None:
            return a
        out.CopyFrom(a)
        return out
    if not isinstance(a, Append):
        raise KvqError.invalid(method, f"{field}: expected kvq.Append, got {type(a).__name__}")
    if not a.sequence_id:
        raise KvqError.invalid(method, f"{field}.sequence_id: empty")
    if out is None:
        out = kvq_pb2.Append()
    out.sequence_id = a.sequence_id
    out.layer = int(a.layer)
    out.start = int(a.start)
    out.model = a.model or ""
    out.basis_version = int(a.basis_version or 0)
    if (a.keys is None) != (a.values is None):
        missing = "values" if a.values is None else "keys"
        raise KvqError.invalid(method, f"{field}.{missing}: missing (keys and values go together)")
    if a.keys is not None:
        k = to_tensor(a.keys, f"{field}.keys", method, ndims=(3,), out=out.keys)
        v = to_tensor(a.values, f"{field}.values", method, ndims=(3,), out=out.values)
        if list(k.shape) != list(v.shape):
            raise KvqError.invalid(
                method,
                f"{field}.values: shape {list(v.shape)} differs from keys {list(k.shape)} "
                "(both [kv_heads, n, head_dim])",
            )
        if k.dtype != v.dtype:
            raise KvqError.invalid(method, f"{field}.values: dtype differs from keys'")
    elif a.token_ids is None:
        raise KvqError.invalid(
            method, f"{field}: neither keys/values nor token_ids (an attach needs token_ids)"
        )
    if a.token_ids is not None:
        ids = np.asarray(a.token_ids)
        if ids.ndim != 1:
            raise KvqError.invalid(method, f"{field}.token_ids: expected one dimension")
        if ids.size and (ids.min() < 0 or ids.max() > 0xFFFFFFFF):
            raise KvqError.invalid(method, f"{field}.token_ids: ids must be uint32")
        out.token_ids.extend(ids.astype(np.uint64).tolist())
    if a.probe_weights is not None:
        to_tensor(a.probe_weights, f"{field}.probe_weights", method, ndims=(2,), f32_only=True,
                  out=out.probe_weights)
    codec = _codec_pb(a.codec, f"{field}.codec", method)
    if codec is not None:
        out.codec.CopyFrom(codec)
    return out


def put_requests(messages: Sequence[Sequence[AnyAppend]], by_shard: Callable[[Sequence[str]], Any],
                 method: str = "PutBlocks") -> Dict[int, List[kvq_pb2.PutBlocksRequest]]:
    """The PutBlocks messages per shard: each message split by shard, order kept."""
    per_shard: Dict[int, List[kvq_pb2.PutBlocksRequest]] = {}
    for m, msg in enumerate(messages):
        prefix = f"messages[{m}].appends" if len(messages) > 1 else "appends"
        _, groups = by_shard([getattr(a, "sequence_id", "") for a in msg])
        for s, idx in (groups or {0: []}).items():
            req = kvq_pb2.PutBlocksRequest()
            for i in idx:
                append_pb(msg[i], f"{prefix}[{i}]", method, out=req.appends.add())
            per_shard.setdefault(s, []).append(req)
    return dict(sorted(per_shard.items()))


def _checked(items: Sequence[Any], cls: Type[_Item], method: str) -> Iterator[Tuple[str, _Item]]:
    """("items[i]", item) for each item, after checking that it is a `cls`."""
    for i, it in enumerate(items):
        f = f"items[{i}]"
        if not isinstance(it, cls):
            raise KvqError.invalid(method, f"{f}: expected kvq.{cls.__name__}, got {type(it).__name__}")
        yield f, it


def attend_request(items: Sequence[AttendItem], method: str = "Attend") -> kvq_pb2.AttendRequest:
    req = kvq_pb2.AttendRequest()
    for f, it in _checked(items, AttendItem, method):
        p = req.items.add(
            sequence_id=it.sequence_id,
            layer=int(it.layer),
            basis_version=int(it.basis_version or 0),
            scale=float(it.scale or 0.0),
            output_dtype=dtype_enum(it.output_dtype, f"{f}.output_dtype", method),
        )
        to_tensor(it.queries, f"{f}.queries", method, ndims=(2, 3), out=p.queries)
        if it.causal_offset is not None:
            p.causal_offset = int(it.causal_offset)
        if it.observe is not None:
            p.observe = bool(it.observe)
        if it.append is not None:
            append_pb(it.append, f"{f}.append", method, out=p.append)
    return req


def score_request(items: Sequence[ScoreItem], method: str = "Score") -> kvq_pb2.ScoreRequest:
    req = kvq_pb2.ScoreRequest()
    for f, it in _checked(items, ScoreItem, method):
        p = req.items.add(
            sequence_id=it.sequence_id,
            layer=int(it.layer),
            basis_version=int(it.basis_version or 0),
            scale=float(it.scale or 0.0),
            corrections_only=bool(it.corrections_only),
        )
        to_tensor(it.queries, f"{f}.queries", method, ndims=(2, 3), out=p.queries)
        if it.append is not None:
            append_pb(it.append, f"{f}.append", method, out=p.append)
    return req


def readout_request(items: Sequence[ReadoutItem], method: str = "Readout") -> kvq_pb2.ReadoutRequest:
    req = kvq_pb2.ReadoutRequest()
    for f, it in _checked(items, ReadoutItem, method):
        p = req.items.add(
            sequence_id=it.sequence_id,
            layer=int(it.layer),
            basis_version=int(it.basis_version or 0),
            weights_are_logits=bool(it.weights_are_logits),
            output_dtype=dtype_enum(it.output_dtype, f"{f}.output_dtype", method),
        )
        to_tensor(it.weights, f"{f}.weights", method, ndims=(3,), f32_only=True, out=p.weights)
    return req


def model_info_pb(info: Union[kvq_pb2.ModelInfo, Mapping[str, Any]]) -> kvq_pb2.ModelInfo:
    if isinstance(info, kvq_pb2.ModelInfo):
        return info
    if not isinstance(info, Mapping):
        raise KvqError.invalid("RegisterBasis", "info: expected kvq_pb2.ModelInfo or a dict")
    fields = dict(info)
    codec = fields.pop("codec", None)
    try:
        out = kvq_pb2.ModelInfo(**fields)
    except (ValueError, TypeError) as e:
        raise KvqError.invalid("RegisterBasis", f"info: {e}") from None
    c = _codec_pb(codec, "info.codec", "RegisterBasis")
    if c is not None:
        out.codec.CopyFrom(c)
    return out


def register_request(
    info: Union[kvq_pb2.ModelInfo, Mapping[str, Any]], basis: Sequence[Any],
    encode_basis: Sequence[Any] = (), query_moment: Sequence[Any] = (),
) -> kvq_pb2.RegisterBasisRequest:
    req = kvq_pb2.RegisterBasisRequest(info=model_info_pb(info))
    for name, tensors in (("basis", basis), ("encode_basis", encode_basis),
                          ("query_moment", query_moment)):
        for layer, t in enumerate(tensors):
            to_tensor(t, f"{name}[{layer}]", "RegisterBasis", ndims=(3,), f32_only=True,
                      out=getattr(req, name).add())
    return req


def item_results(method: str, results: Sequence[Any], field: str, bf16: str = "uint16") -> List[ItemResult]:
    """ItemResults from the proto results (outputs decoded to numpy)."""
    out = []
    for i, r in enumerate(results):
        code = code_from_int(r.status.code)
        arr = None
        if code == grpc.StatusCode.OK and r.HasField(field):
            arr = from_tensor(getattr(r, field), bf16=bf16, field=f"results[{i}].{field}", method=method)
        out.append(ItemResult(code, r.status.message, int(r.tokens), arr, method=method, index=i))
    return out


def check_results(results: List[ItemResult]) -> List[ItemResult]:
    """Raises KvqError for the first failed item (message "items[i]: ...")."""
    for r in results:
        r.raise_for_status()
    return results


def merge_stats(parts: Sequence[kvq_pb2.StatsResponse]) -> kvq_pb2.StatsResponse:
    """The sum of several servers' Stats: counts summed, bits per element weighted by tokens,
    uptime the shortest; names (tenant, pool, backend) from the first server."""
    if len(parts) == 1:
        return parts[0]
    out = kvq_pb2.StatsResponse()
    out.CopyFrom(parts[0])
    for name in (
        "sequences", "tokens", "stored_bytes", "quota_bytes", "evictions", "prefix_blocks",
        "prefix_bytes", "retained_prefix_bytes", "shared_tokens", "server_stored_bytes",
        "server_capacity_bytes",
    ):
        setattr(out, name, sum(getattr(p, name) for p in parts))
    tokens = sum(p.tokens for p in parts)
    for name in ("k_bits_per_element", "v_bits_per_element"):
        if tokens > 0:
            setattr(out, name, sum(getattr(p, name) * p.tokens for p in parts) / tokens)
    out.uptime_seconds = min(p.uptime_seconds for p in parts)
    return out


def merge_put(parts: Sequence[kvq_pb2.PutBlocksResponse]) -> kvq_pb2.PutBlocksResponse:
    out = kvq_pb2.PutBlocksResponse()
    for p in parts:
        out.messages += p.messages
        out.appends += p.appends
        out.tokens_written += p.tokens_written
        out.tokens_duplicate += p.tokens_duplicate
        out.tokens_shared += p.tokens_shared
        out.lengths.extend(p.lengths)
    return out


def parse_health(raw: bytes) -> bool:
    """True when a grpc.health.v1.HealthCheckResponse says SERVING (field 1, value 1)."""
    return raw == b"\x08\x01"


def block_of(chunk: kvq_pb2.GetBlocksResponse, bf16: str, method: str = "GetBlocks") -> Block:
    return Block(
        layer=int(chunk.layer),
        start=int(chunk.start),
        keys=from_tensor(chunk.keys, bf16=bf16, field="keys", method=method),
        values=from_tensor(chunk.values, bf16=bf16, field="values", method=method),
        layer_tokens=int(chunk.layer_tokens),
        basis_version=int(chunk.basis_version),
    )

# The response message of each batched call (the merge of a split call builds one).
_RESPONSE = {
    "Score": kvq_pb2.ScoreResponse,
    "Readout": kvq_pb2.ReadoutResponse,
    "Attend": kvq_pb2.AttendResponse,
}
