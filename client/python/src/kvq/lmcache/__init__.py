"""kvq as LMCache's remote KV store (a remote-storage plugin; needs lmcache and torch).

LMCache configuration (YAML or LMCACHE_* environment), the plugin's keys under
`remote_storage_plugin.<name>.` in extra_config (see kvq.lmcache.config.KNOWN_KEYS):

    remote_storage_plugins: ["kvq"]
    extra_config:
      remote_storage_plugin.kvq.module_path: kvq.lmcache
      remote_storage_plugin.kvq.class_name: KvqConnector
      remote_storage_plugin.kvq.server: 127.0.0.1:50051
      remote_storage_plugin.kvq.model: smollm2-135m
      remote_storage_plugin.kvq.codec: '{"key_bits": 2, "key_group": 128}'
"""

from typing import Any

from .config import KNOWN_KEYS, PluginConfig, PluginConfigError, parse_plugin_config


def __getattr__(name: str) -> Any:
    # The connector imports lmcache (and torch): only when LMCache asks for the class, so that
    # the settings parser and the docs load without them.
    if name in ("KvqConnector", "KvqConnectorAdapter"):
        from . import connector
        return getattr(connector, name)
    if name == "sequence_id_for":
        from .layout import sequence_id_for
        return sequence_id_for
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "KvqConnector",
    "KvqConnectorAdapter",
    "PluginConfig",
    "PluginConfigError",
    "parse_plugin_config",
    "sequence_id_for",
    "KNOWN_KEYS",
]
