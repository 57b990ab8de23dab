"""The ``kvbridge`` command.

============  ==============================================================================
options       every option value checked as it is parsed (one line, exit status 2)
plan_report   what ``kvbridge plan`` prints (a row per rank pair, table or JSON)
configref     renders docs/configuration.md from the settings and the connector's options
bench         the ``bench`` commands
commands      ``kvbridge plan / bench / demo / bootstrap / proxy / models / chaos``
============  ==============================================================================
"""

from kvbridge.cli.commands import main, run

__all__ = ["main", "run"]
