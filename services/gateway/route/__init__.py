"""Which worker group takes a request: `kv_index` (the prefix blocks each group holds, fed by
the groups' KVEvents), `router` (the policy: cache overlap against load, least load or round
robin, and load shedding past the queue bounds), both pure; `kv_events_reader` (the stream
edge feeding the index) and `metrics` (the routing decisions and each group's load, for
dashboards and autoscaling).
"""
