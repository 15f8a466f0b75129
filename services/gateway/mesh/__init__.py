"""What the gateway knows of the mesh behind it, learned from the heartbeat stream.

`groups` (the pure view: schedulers by instance, alive or not, which model and role, whether a
request for a model can be served now) then `heartbeat_reader` (the stream edge feeding it).
"""
