"""The kvq plugin's settings, read from LMCache's `extra_config`.

LMCache names a remote-storage plugin in `remote_storage_plugins` and finds its settings in
`extra_config` under `remote_storage_plugin.<name>.<key>` (the same prefix as its own
`module_path` and `class_name`). This module turns those keys into a `PluginConfig` and
refuses anything it cannot use with a ValueError naming the full key, so that a typo in a
serving engine's YAML points at the line to fix. It does not import LMCache or torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional

from ..types import CodecSettings

__all__ = ["PluginConfig", "PluginConfigError", "parse_plugin_config", "plugin_prefix", "KNOWN_KEYS"]


class PluginConfigError(ValueError):
    """A setting of the kvq plugin that is missing or invalid; str() starts with the key."""

    def __init__(self, key: str, problem: str) -> None:
        self.key = key
        super().__init__(f"{key}: {problem}")


# Keys this plugin reads (besides LMCache's own module_path / class_name), with what they mean.
KNOWN_KEYS = {
    "server": "kvq server address host:port; several comma-separated shard over the hash ring",
    "model": "the kvq registry model the chunks are encoded for (kvq models register ...)",
    "basis_version": "basis version to pin new chunks to; 0: the latest",
    "codec": "codec overrides (a JSON object or dict of CodecSettings fields, as codec.json)",
    "tenant": "x-kvq-tenant metadata for a server without auth (ignored with a token)",
    "token": "bearer token (auth on: the token names the tenant)",
    "tls": "true: TLS to the server",
    "ca_file": "PEM file of the CA that signed the server (TLS)",
    "cert_file": "client certificate PEM (mutual TLS)",
    "key_file": "client private key PEM (mutual TLS)",
    "deadline_s": "deadline of each RPC, seconds",
    "sequence_prefix": "prefix of the kvq sequence id of each chunk",
    "max_workers": "threads that run the blocking RPCs off LMCache's event loop",
    "codes": "true (default): chunks travel as HeadQ codes encoded and decoded here; false: fp16",
}
_LMCACHE_KEYS = {"module_path", "class_name"}

# CodecSettings fields as codec.json names them (docs/API.md, "The registry folder").
_CODEC_FIELDS = {f.name: f.type for f in fields(CodecSettings)}


def plugin_prefix(plugin_name: str) -> str:
    return f"remote_storage_plugin.{plugin_name}."


@dataclass(frozen=True)
class PluginConfig:
    plugin_name: str
    servers: tuple[str, ...]
    model: str
    basis_version: int = 0
    codec: Optional[CodecSettings] = None
    tenant: Optional[str] = None
    token: Optional[str] = None
    tls: bool = False
    root_certificates: Optional[bytes] = None
    certificate_chain: Optional[bytes] = None
    private_key: Optional[bytes] = None
    deadline_s: float = 30.0
    sequence_prefix: str = "lmcache/"
    max_workers: int = 4
    codes: bool = True

    def key(self, name: str) -> str:
        """The full extra_config key of one of this plugin's settings."""
        return plugin_prefix(self.plugin_name) + name


def _as_bool(key: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
        return v.strip().lower() in ("true", "1", "yes", "on")
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    raise PluginConfigError(key, f"expected true or false, got {v!r}")


def _as_int(key: str, v: Any, lo: int, hi: int) -> int:
    try:
        if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
            raise ValueError
        n = int(v)
    except (TypeError, ValueError):
        raise PluginConfigError(key, f"expected an integer, got {v!r}") from None
    if not lo <= n <= hi:
        raise PluginConfigError(key, f"{n} is outside {lo}..{hi}")
    return n


def _read_file(key: str, path: Any) -> bytes:
    try:
        with open(str(path), "rb") as f:
            return f.read()
    except OSError as e:
        raise PluginConfigError(key, f"cannot read {path!r}: {e.strerror}") from None


def _parse_codec(key: str, v: Any) -> Optional[CodecSettings]:
    if v is None or v == "":
        return None
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except json.JSONDecodeError as e:
            raise PluginConfigError(key, f"not a JSON object: {e.msg} at char {e.pos}") from None
    if not isinstance(v, Mapping):
        raise PluginConfigError(key, f"expected a JSON object of codec settings, got {type(v).__name__}")
    out: dict[str, Any] = {}
    for name, value in v.items():
        if name not in _CODEC_FIELDS:
            raise PluginConfigError(f"{key}.{name}", f"unknown codec setting (known: {', '.join(_CODEC_FIELDS)})")
        sub = f"{key}.{name}"
        if value is None:
            continue  # the model's default, as if absent
        if name == "value_policy":
            if value not in ("uniform", "a2"):
                raise PluginConfigError(sub, f"{value!r} is not one of uniform, a2")
            out[name] = value
        elif name == "value_budget":
            try:
                out[name] = float(value)
            except (TypeError, ValueError):
                raise PluginConfigError(sub, f"expected a number, got {value!r}") from None
        elif name in ("rotate_keys", "rotate_values", "metric_rounding"):
            if not isinstance(value, bool):
                raise PluginConfigError(sub, f"expected true or false, got {value!r}")
            out[name] = value
        else:
            # The server checks the allowed values (2/3/4/8 bits and so on) and names the
            # field; here only the type, so that one place keeps the rules.
            out[name] = _as_int(sub, value, 0, 65536)
    return CodecSettings(**out)


def parse_plugin_config(plugin_name: str, extra_config: Optional[Mapping[str, Any]]) -> PluginConfig:
    """Reads `remote_storage_plugin.<plugin_name>.*` from LMCache's extra_config."""
    prefix = plugin_prefix(plugin_name)
    extra = dict(extra_config or {})
    mine = {k[len(prefix):]: v for k, v in extra.items() if isinstance(k, str) and k.startswith(prefix)}
    unknown = sorted(k for k in mine if k not in KNOWN_KEYS and k not in _LMCACHE_KEYS)
    if unknown:
        # A misspelt key would otherwise silently fall back to a default (e.g. the codec).
        raise PluginConfigError(prefix + unknown[0], f"unknown setting (known: {', '.join(KNOWN_KEYS)})")

    def required(name: str) -> str:
        v = mine.get(name)
        if v is None or (isinstance(v, str) and not v.strip()):
            raise PluginConfigError(prefix + name, f"required ({KNOWN_KEYS[name]})")
        return str(v).strip()

    server = required("server")
    servers = tuple(s.strip() for s in server.split(",") if s.strip())
    for s in servers:
        host, sep, port = s.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise PluginConfigError(prefix + "server", f"{s!r} is not host:port")
    model = required("model")

    kwargs: dict[str, Any] = {}
    if "basis_version" in mine:
        kwargs["basis_version"] = _as_int(prefix + "basis_version", mine["basis_version"], 0, 1 << 30)
    kwargs["codec"] = _parse_codec(prefix + "codec", mine.get("codec"))
    for name in ("tenant", "token"):
        if mine.get(name) not in (None, ""):
            kwargs[name] = str(mine[name])
    if "tls" in mine:
        kwargs["tls"] = _as_bool(prefix + "tls", mine["tls"])
    for name, attr in (("ca_file", "root_certificates"), ("cert_file", "certificate_chain"),
                       ("key_file", "private_key")):
        if mine.get(name):
            kwargs[attr] = _read_file(prefix + name, mine[name])
    if ("cert_file" in mine) != ("key_file" in mine):
        raise PluginConfigError(prefix + ("key_file" if "cert_file" in mine else "cert_file"),
                                "cert_file and key_file go together (mutual TLS)")
    if (kwargs.get("root_certificates") or kwargs.get("certificate_chain")) and not kwargs.get("tls"):
        raise PluginConfigError(prefix + "tls", "ca_file/cert_file given but tls is not true")
    if "deadline_s" in mine:
        try:
            d = float(mine["deadline_s"])
        except (TypeError, ValueError):
            raise PluginConfigError(prefix + "deadline_s", f"expected seconds, got {mine['deadline_s']!r}") from None
        if not 0 < d <= 3600:
            raise PluginConfigError(prefix + "deadline_s", f"{d} is outside (0, 3600]")
        kwargs["deadline_s"] = d
    if "sequence_prefix" in mine:
        p = str(mine["sequence_prefix"])
        if len(p.encode()) > 64:
            raise PluginConfigError(prefix + "sequence_prefix", "longer than 64 bytes")
        kwargs["sequence_prefix"] = p
    if "codes" in mine:
        kwargs["codes"] = _as_bool(prefix + "codes", mine["codes"])
    if "max_workers" in mine:
        kwargs["max_workers"] = _as_int(prefix + "max_workers", mine["max_workers"], 1, 64)
    return PluginConfig(plugin_name=plugin_name, servers=servers, model=model, **kwargs)
