"""kvbridge's TEST-ONLY stand-in for ``torchvision``.

The registry's torchvision is a CUDA build that fails on the CPU torch ("torchvision::nms does
not exist"), yet SGLang 0.5.23 and transformers 5.19 import it (``torchvision.io``,
``torchvision.transforms`` and names from them) while loading a model's config, and transformers
parses its ``__version__`` once it is found. This package, any submodule and any name in it can
be imported; any use of such a name (a call above all) raises RuntimeError. It is put only on
the path of the venv that scripts/sglang_env.sh builds, never into kvbridge's own environment.
"""

from _kvbridge_standin import stand_in

# The torchvision release that goes with torch 2.13, marked as what it is.
__version__ = "0.28.0+kvbridge.standin"

stand_in(__name__)
del stand_in
