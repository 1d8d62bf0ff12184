"""Local Redis topologies the launcher starts (run-level): ``ha.py`` (``redis=ha``: a
primary, a replica, three sentinels), ``cluster.py`` (``redis=cluster``), ``acl.py`` (their
per-run ACL users), ``cluster_move.py`` (``python -m pipeline.topology.cluster_move``)."""
