"""``python -m kvbridge``: the ``kvbridge`` command."""

from kvbridge.cli import run

run()
