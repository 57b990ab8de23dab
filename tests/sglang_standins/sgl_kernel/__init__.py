"""kvbridge's TEST-ONLY stand-in for ``sgl_kernel`` (SGLang's CUDA kernel package).

SGLang 0.5.23 imports ``sgl_kernel`` at start-up even on its CPU path (``from sgl_kernel import
copy_all_layer_kv_cache_cpu`` in ``kernels/ops/kvcache/cache_move.py``), where none of its ops
is called on the path kvbridge's tests take; the registry's wheels (sgl-kernel, sglang-kernel)
hold only CUDA ops. This package, any submodule and any name in it can be imported; any use of
such a name (a call above all) raises RuntimeError. It is put only on the path of the venv that
scripts/sglang_env.sh builds, never into kvbridge's own environment.
"""

from _kvbridge_standin import stand_in

stand_in(__name__)
del stand_in
