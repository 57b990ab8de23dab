"""Whole deployments of real processes, for the tests, the bench, the demo and the chaos soak.

==========  ================================================================================
shield      every such process started ignoring the terminal's Ctrl-C (the command alone is
            interrupted, and ends them)
netns       several hosts on this machine: network namespaces on one switch; partitions,
            bandwidth caps, delay and loss
linkdelay   the delay: queued packets held in user space over nfnetlink_queue
cluster     a deployment's rank processes (forked from a server with kvbridge imported), on
            this host's loopback or each part on a host of its own
==========  ================================================================================
"""
