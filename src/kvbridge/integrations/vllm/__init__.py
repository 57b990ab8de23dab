"""kvbridge inside vLLM: a KV connector vLLM loads by module path
(``kvbridge.integrations.vllm.connector``, class ``KVBridgeConnector``), and ``kvbridge proxy``.

Reading order: ``params`` (what travels in kv_transfer_params; the connector's options) ->
``memory`` (vLLM's KV tensors as kvbridge buffers) -> ``scheduler`` -> ``worker`` ->
``connector`` (vLLM's class) -> ``proxy``. Only ``connector`` imports vLLM.
"""
