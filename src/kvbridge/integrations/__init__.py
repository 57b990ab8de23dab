"""Adapters that let serving engines use kvbridge through their own plug-in points. An adapter
translates the engine's vocabulary and memory into sides, placements, senders and receivers;
it contains no slicing logic."""
