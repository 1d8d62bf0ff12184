"""Keep Routing through DeepSpeed AutoEP's router, on the ranks of an expert group.

``python -m tests.autoep_ranks OUT.json MODEL_DIR`` with RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT set (tests/test_autoep.py starts the ranks). The deepspeed
backend with ZeRO-3 and ``trainer.expert_parallel`` = world size; each rank feeds its
own batch (so the all-to-all moves uneven token counts), records the experts every
AutoEP router picked, then runs the same batch again with those routes forced
(``routing.force_autoep_routes``) and with every id moved to the next expert. Rank 0
writes the largest logit difference over both ranks from the first forward for each.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from pipeline import routing
from tests.trainer_ranks import config
from trainer.backends import make_backend
from trainer.ranks import barrier, close, init_ranks


def main() -> None:
    out, model_dir = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    cfg = config("deepspeed", 3, world, "float32")
    cfg.trainer.expert_parallel = world
    ranks = init_ranks(world, "cpu", 60.0, need_dist=True)
    backend = make_backend(cfg, ranks, model_dir, None)
    engine = backend.engine
    routers = routing.autoep_routers(engine.module)
    g = torch.Generator().manual_seed(100 + ranks.rank)
    ids = torch.randint(10, 90, (2, 5 + 3 * ranks.rank), generator=g)
    picked: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda m, i, o: picked.append(o[1].detach())) for r in routers]
    with torch.no_grad():
        free = engine(input_ids=ids).logits
        for h in hooks:
            h.remove()
        with routing.force_autoep_routes(engine.module, picked):
            same = engine(input_ids=ids).logits
        moved = [(p + 1) % routers[0].num_experts for p in picked]
        with routing.force_autoep_routes(engine.module, moved):
            other = engine(input_ids=ids).logits
    diffs = torch.tensor([float((same - free).abs().max()), float((other - free).abs().max())])
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
    if ranks.is_main:
        result = {
            "routers": len(routers),
            "picked_shapes": [list(p.shape) for p in picked],
            "same": float(diffs[0]),
            "moved": float(diffs[1]),
        }
        with open(out + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(out + ".tmp", out)
    barrier(ranks)
    close(ranks)


if __name__ == "__main__":
    main()
