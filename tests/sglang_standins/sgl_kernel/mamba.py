"""kvbridge's TEST-ONLY ``sgl_kernel.mamba``: the three names SGLang 0.5.23's CPU path imports
from it (``layers/attention/linear/gdn_backend.py``, ``kernels/gdn_triton.py``,
``kda_backend.py``), computing in pure torch (``_torch_ops``). Any other name is absent, so
``from sgl_kernel.mamba import X`` of one fails at import, naming it."""

from sgl_kernel._torch_ops import (
    causal_conv1d_fn as causal_conv1d_fn_cpu,
)
from sgl_kernel._torch_ops import (
    causal_conv1d_update as causal_conv1d_update_cpu,
)
from sgl_kernel._torch_ops import (
    chunk_gated_delta_rule as chunk_gated_delta_rule_cpu,
)

__all__ = ["causal_conv1d_fn_cpu", "causal_conv1d_update_cpu", "chunk_gated_delta_rule_cpu"]
