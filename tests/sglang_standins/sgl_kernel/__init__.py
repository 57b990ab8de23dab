"""kvbridge's TEST-ONLY stand-in for ``sgl_kernel`` (SGLang's CUDA kernel package).

SGLang 0.5.23 imports ``sgl_kernel`` at start-up even on its CPU path (``from sgl_kernel import
copy_all_layer_kv_cache_cpu`` in ``kernels/ops/kvcache/cache_move.py``), where none of its ops
is called on the path kvbridge's dense-model tests take; the registry's wheels (sgl-kernel,
sglang-kernel) hold only CUDA ops. This package, any submodule and any name in it can be
imported; any use of such a name (a call above all) raises RuntimeError. It is put only on the
path of the venv that scripts/sglang_env.sh builds, never into kvbridge's own environment.

For hybrid models (GDN, Mamba2) SGLang's CPU path does call kernels, so these few compute, in
pure torch (``_torch_ops``; README.md here lists them):

- ``sgl_kernel.mamba`` (a real submodule): causal_conv1d_fn_cpu, causal_conv1d_update_cpu,
  chunk_gated_delta_rule_cpu;
- ``torch.ops.sgl_kernel.fused_gdn_gating_cpu`` and
  ``torch.ops.sgl_kernel.fused_sigmoid_gating_delta_rule_update_cpu``, registered below with
  torch.library under the real kernels' schemas (SGLang looks them up when its GDN backend is
  imported, for every hybrid model, and calls the second with keywords);
- through ``_sglang_patches``, installed below: the Mamba2 kernels and the gated RMSNorm that
  SGLang's CPU path leaves unbound or sends to Triton, set on SGLang's modules as they load.
"""

import torch
from _kvbridge_standin import stand_in

from sgl_kernel import _sglang_patches, _torch_ops


def _gdn_gating(A_log, a, b, dt_bias):  # noqa: N803 (SGLang's argument names)
    """[1, T, HV] g and beta, as SGLang's CPU kernel returns them (GDN prefill)."""
    g, beta = _torch_ops.gdn_gating(A_log, a, b, dt_bias)
    return g.unsqueeze(0), beta.unsqueeze(0)


def _register_ops() -> None:
    # FRAGMENT: the namespace is the real package's; a fragment adds ops to it without owning it.
    lib = torch.library.Library("sgl_kernel", "FRAGMENT")
    lib.define(
        "fused_gdn_gating_cpu(Tensor A_log, Tensor a, Tensor b, Tensor dt_bias) -> (Tensor, Tensor)"
    )
    lib.impl("fused_gdn_gating_cpu", _gdn_gating, "CPU")
    lib.define(
        "fused_sigmoid_gating_delta_rule_update_cpu(Tensor A_log, Tensor dt_bias, Tensor q, "
        "Tensor k, Tensor v, Tensor a, Tensor b, Tensor(a!) initial_state_source, "
        "Tensor initial_state_indices, Tensor? cu_seqlens, bool use_qk_l2norm_in_kernel, "
        "float softplus_beta=1.0, float softplus_threshold=20.0) -> Tensor"
    )
    lib.impl(
        "fused_sigmoid_gating_delta_rule_update_cpu",
        _torch_ops.fused_sigmoid_gating_delta_rule_update,
        "CPU",
    )
    # The registrations last as long as the Library object.
    globals()["_LIBRARY"] = lib


_register_ops()
_sglang_patches.install()

stand_in(__name__)
del stand_in
