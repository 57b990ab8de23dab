"""``kvbridge demo``: disaggregated generation on real Hugging Face architectures, checked exactly.

Tiny models of real architectures (transformers, random weights from a fixed seed, float32 on
CPU) run as a deployment of real processes: each prefill rank runs the model on the prompt in
chunks, writes its shard of the cache the HF model produced into its paged pools, and sends each
chunk through kvbridge; each decode rank receives into its pools; decode rank 0 gathers the
decode ranks' pools, rebuilds the HF cache object and continues greedy generation. A case passes
when the tokens equal those of the same model run undisturbed in one process and every cache
tensor rebuilt on the decode side equals the undisturbed one bit for bit.

Reading order (torch and transformers are imported by the worker processes, and by the parent
only to prove a user's config):

* :mod:`.models`     the tiny model cases and the CacheSpec of exactly the cache HF produces;
* :mod:`.cache_io`   HF cache <-> kvbridge logical tensors, pools -> logical (across TP ranks);
* :mod:`.deployment` one case's job, sides, memory and placements (no torch);
* :mod:`.forward`    the model's forward as every process runs it, and the proof that a
  user's config runs, before any process starts;
* :mod:`.workers`    the bodies of the prefill, decode and reference processes (imports torch);
* :mod:`.run`        topologies, one case as a deployment (bootstrap server + processes), checks;
* :mod:`.matrix`     the default matrix, progress and the final table (``kvbridge demo``).

Needs ``pip install 'kvbridge[demo]'`` (torch 2.13.0, the CPU build, and transformers 5.23.0).
``KVBRIDGE_FAULTS=shift_bytes=8 kvbridge demo`` shows the check failing on corrupted bytes.
"""
