"""What a model's cache is: the first layer above the errors, pure (no threads, no sockets).

============  ==============================================================================
spec          :class:`CacheSpec`: layers, components (per token or per request), segments;
              builders per cache kind
states        builders of the recurrent kinds outside the Mamba family: MiniMax's lightning
              attention, xLSTM's mLSTM, RecurrentGemma's RG-LRU
modelconfig   a Hugging Face ``config.json`` read from a shipped preset (``presets/``), a file
              or a model directory
hf/           a CacheSpec from such a config: ``fields`` (typed reads) -> ``families`` (each
              family's layer mixers) -> ``builders`` (a LayerSpec per mixer)
============  ==============================================================================
"""
