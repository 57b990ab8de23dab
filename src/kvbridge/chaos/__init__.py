"""``kvbridge chaos``: faults against a real deployment, every promise checked.

==========  ================================================================================
process     a rank in its own process, driven by commands (stall, kill)
ranks       a rank that reuses pages only when released and counts late bytes
config      what a soak is asked to do: fault kinds, shapes, requests, deadlines
deployment  the soak's rank processes, restartable, and the request slots it hands out
soak        faults drawn per round, every promise checked
fuzz        every decoder of outside input as a fuzz target
==========  ================================================================================
"""
