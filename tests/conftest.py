import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).parent))

# No property test is timed: an example's time on two cores shared with engine servers and
# another worker says nothing of the code (test_bench_rawtcp's slices, 0.94 s against
# Hypothesis' default 200 ms deadline under three workers; docs/testing.md).
settings.register_profile("kvbridge", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("kvbridge")

# One compute thread a test process (torch's OpenMP, numpy's BLAS), inherited by the processes
# the tests start: two pytest workers and the engine servers (each pinned to a core of its own)
# share two cores, and a thread a core in every process oversubscribed them (a sweep test of
# 2.4 s alone took 47 s in the suite; three of them beside two busy processes: 40 s with two
# threads, 27 s with one). The engine servers and the demo's ranks set one thread themselves.
os.environ.setdefault("OMP_NUM_THREADS", "1")  # (before torch is first imported: checked)

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


@pytest.fixture(scope="session")
def sglang_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny models the SGLang server modules serve (sglang_hybrid_models.SUITE_MODELS, by
    directory name), built once a session in one process of SGLang's venv (under
    pytest-xdist, by the worker that runs the engines' group); skips, saying why, where SGLang's
    environment is missing."""
    import sglang_hybrid_models
    import sglang_servers

    python = sglang_servers.sglang_python()
    return sglang_hybrid_models.make_models(python, tmp_path_factory.mktemp("sglang-models"))


# Modules that start vLLM or SGLang servers: their engines are pinned to cores (prefill on 0,
# decode on 1) and each takes seconds of CPU to start, so two such modules at once on two
# pytest-xdist workers stall each other's engines past kvbridge's deadlines (seen: a TP 2
# prefill's transfer timing out). Under scripts/test.sh (--dist loadgroup) they are one group,
# run one after another on one worker while the other workers take the rest (xdist starts the
# groups with the most tests first: docs/testing.md; serially they come first); every
# other module is a group of its own (its fixtures set up once, by one worker). The demo with
# a real model's trained weights (SmolLM2, 30 layers read from disk, transformers' reference
# run beside the ranks) joins them: twice it ran beside the vLLM TP module and both stalled
# past their deadlines (adab9c0 and adb5529: docs/testing.md). The engines' other modules
# (pools, stand-ins, descriptions: no server) are not in the group, which was the suite's
# longest path until its servers started from a fork server (docs/testing.md).
# test_architecture.py checks that every module starting servers is listed.
ENGINE_MODULES = frozenset(
    {
        "test_demo_weights",
        "test_sglang_backend",
        "test_sglang_hybrid_pd",
        "test_sglang_mla_pd",
        "test_sglang_swa_pd",
        "test_vllm_connector",
        "test_vllm_gdn",
        "test_vllm_hybrid",
        "test_vllm_tp",
    }
)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups into the node ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = item.path.stem
        group = "engines" if module in ENGINE_MODULES else module
        item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: item.path.stem not in ENGINE_MODULES)  # stable
