"""``python -m kvbridge``: the ``kvbridge`` command."""

from kvbridge.cli import main

main(prog_name="kvbridge")
