"""kvbridge's vLLM plugin: the connector registered by name in every vLLM process.

vLLM runs the ``vllm.general_plugins`` entry points (``pyproject.toml``) in each of its
processes, its front-end included. Registered there, ``"kv_connector": "KVBridgeConnector"``
needs no ``kv_connector_module_path``, and vLLM's ``MultiConnector`` can rebuild kvbridge's
statistics by name in the front-end, which never imports the connector itself (unregistered,
that lookup failed and took the request with it).
"""

from __future__ import annotations

NAME = "KVBridgeConnector"
MODULE = "kvbridge.integrations.vllm.connector"


def register() -> None:
    """Register the connector with vLLM's connector factory (once; vLLM imports the module
    only when a connector of that name is made)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(NAME, MODULE, NAME)
