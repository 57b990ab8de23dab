"""kvbridge as SGLang's transfer backend (``--disaggregation-transfer-backend kvbridge``).

==========  ============================================================================
pools       SGLang's pools (``KVArgs``) as kvbridge's spec and memory; plain data
internals   every touch of SGLang beyond its backend base classes, version-checked
backend     the manager, sender, receiver and bootstrap server SGLang drives
plugin      the ``sglang.srt.plugins`` entry point that registers them
launch      real SGLang servers and the router, for the tests and the benchmark
==========  ============================================================================

Only ``internals`` and ``backend`` import SGLang (``plugin`` does through them, when SGLang
runs it).
"""
