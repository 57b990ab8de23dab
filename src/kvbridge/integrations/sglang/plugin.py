"""kvbridge's SGLang plugin: ``--disaggregation-transfer-backend kvbridge`` in every SGLang
process, without patching SGLang.

SGLang runs the ``sglang.srt.plugins`` entry points (``pyproject.toml``) in its launcher and in
every scheduler process, then applies the hooks they registered. :func:`register` adds the
backend's name and classes (:mod:`.internals` holds every touch of SGLang's internals) and
imports nothing of the backend until a server selects it. Another SGLang release is refused
where a server selects kvbridge, naming both releases; servers that do not select it are left
alone.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

log = logging.getLogger("kvbridge.sglang")


def _classes(kind: str) -> type | None:
    from kvbridge.integrations.sglang.backend import CLASSES

    return CLASSES.get(kind)


def register() -> None:
    from kvbridge.integrations.sglang import internals

    try:
        internals.add_backend(_classes)
        internals.add_request_hooks(_note_request, _note_prompt)
        internals.add_window_hook()
    except (ImportError, AttributeError) as e:  # another release's internals
        log.warning(
            "kvbridge's SGLang backend is not available in SGLang %s (it supports %s): %s",
            internals.version(),
            internals.SUPPORTED,
            e,
        )


def _note_request(receiver: object, token_ids: Sequence[int]) -> None:
    from kvbridge.integrations.sglang.receiver import note_request

    note_request(receiver, token_ids)


def _note_prompt(sender: object, token_ids: Sequence[int]) -> None:
    from kvbridge.integrations.sglang.sender import note_prompt

    note_prompt(sender, token_ids)
