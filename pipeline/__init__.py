"""The base every pool imports and the run-level tools above the pools (pipeline/README.md).

Modules that moved when the folders were grouped by floor: importing one, or running it
with ``python -m``, fails naming where it is now (``MOVED``)."""

from __future__ import annotations

import sys
from importlib.abc import MetaPathFinder

MOVED = {
    "pipeline.accounting": "pipeline.run.accounting",
    "pipeline.cpu_meter": "pipeline.run.cpu_meter",
    "pipeline.orphans": "actor.orphans",
    "pipeline.progress": "pipeline.run.progress",
    "pipeline.prom_server": "pipeline.run.prometheus",
    "pipeline.redis_acl": "pipeline.topology.acl",
    "pipeline.redis_cluster": "pipeline.topology.cluster",
    "pipeline.redis_cluster_move": "pipeline.topology.cluster_move",
    "pipeline.redis_ha": "pipeline.topology.ha",
    "pipeline.redis_server": "pipeline.redisd.server",
    "pipeline.redis_tls": "pipeline.redisd.tls",
    "pipeline.summary": "pipeline.run.summary",
    "pipeline.summary_fields": "pipeline.run.summary_fields",
    "pipeline.supervisor": "pipeline.run.supervisor",
    "pipeline.weight_publisher": "trainer.weight_publisher",
    "pipeline.weight_receiver": "actor.weight_receiver",
    "pipeline.weights": "pipeline.transfer.buckets",
}


class _Moved(MetaPathFinder):
    """Last on ``sys.meta_path``: asked only for a module no other finder found."""

    def find_spec(self, name, path=None, target=None):
        if name in MOVED:
            new = MOVED[name]
            raise ModuleNotFoundError(
                f"{name} moved to {new}: use that name (in imports, after python -m)", name=name
            )
        return None


if not any(isinstance(f, _Moved) for f in sys.meta_path):
    sys.meta_path.append(_Moved())
