"""What travels between ranks on the control channel.

==========  ================================================================================
liveness    process identity (a rank's incarnation) and peer silence
protocol    versioned, named, validated messages (msgspec); rank descriptions on the wire
==========  ================================================================================
"""
