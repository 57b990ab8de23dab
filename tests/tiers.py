"""The suite's two tiers. ``python3 -m pytest`` runs every test, each property test with its full
example count; ``python3 -m pytest -m "not slow"`` is the fast tier, for the edit-test loop
(under a minute on two cores): it leaves out the tests marked ``slow`` (those that start
deployments, agents, engine servers, commands or fork servers, a second or more each; deadlines
waited out; the few in-process ones of seconds) and runs the property tests that draw many examples
(those whose ``@settings`` say ``examples(n)``) on a tenth of them.

``FAST`` is set by conftest.py before any test module is imported, so that ``examples(n)`` in a
``@settings`` decorator sees it.
"""

from __future__ import annotations

import re

FAST = False


def fast_tier(markexpr: str) -> bool:
    """Whether a ``-m`` expression is the fast tier's: one that leaves out the ``slow`` tests."""
    return re.search(r"\bnot\s+slow\b", markexpr) is not None


def examples(n: int) -> int:
    """A property test's ``max_examples``: ``n`` in the full suite, a tenth of it (at least 10)
    in the fast tier."""
    return max(n // 10, 10) if FAST else n
