"""``python -m kvbridge.cli``: the ``kvbridge`` command."""

from kvbridge.cli.commands import run

run()
