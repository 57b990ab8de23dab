import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import tiers  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    # Before any test module is imported: their @settings read tiers.examples().
    tiers.FAST = tiers.fast_tier(config.getoption("markexpr") or "")


@pytest.fixture(scope="session")
def vllm_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny models the vLLM test modules serve, built once a session in one process (under
    pytest-xdist, by each worker that runs a vLLM module, in its own temporary directory:
    vllm_servers.MODELS); skips, saying why, where vLLM's environment is missing."""
    import vllm_servers

    vllm_servers.require_vllm()
    return vllm_servers.make_models(tmp_path_factory.mktemp("models"))
