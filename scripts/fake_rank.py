#!/usr/bin/env python
"""train.py's loop as rank 0 of W over torch's fake process group: what one rank of a
W-process run costs, on a machine with one GPU (or none).

    python scripts/fake_rank.py --world 2 --run-dir /tmp/r -- device=cuda model=resnet18 \\
        trainer.batch_size=256 trainer.micro_batch_size=64 amp=on trainer.on_nonfinite=continue

The process computes rank 0's share of every step's micro-batches and makes every
collective of the reduction and every message a rank sends, but the fake group moves
nothing between ranks and waits for no peer: the time is a rank's own (its micro-batches,
the reduction's host and device work), without the wire. The values mean nothing (torch
2.11's fake all-to-all leaves its output uninitialized: add ``trainer.on_nonfinite=continue``
should the garbage stop the run). Prints the run's summary as one JSON line.
``scripts/dist_benchmark.py --fake-world W`` and ``scripts/profile_step.py --fake-world W``
run it.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def rank_zero_env(world_size: int) -> dict[str, str]:
    """What torchrun would set for rank 0 of ``world_size``."""
    return {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world_size)}


def join_fake_world(cfg: Any) -> None:
    """Join torch's fake process group as rank 0 of ``WORLD_SIZE`` (the environment's), so
    that ``repro.engine.dist.init`` finds the group and keeps it; put the NCCL settings in place as
    ``repro.engine.dist.init`` would (strict mode checks them; nothing reads them here)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world_size = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    os.environ.update({str(k): str(v) for k, v in cfg.determinism.nccl_env.items()})


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--world", type=int, required=True, help="W: the world rank 0 is part of")
    p.add_argument("--run-dir", type=Path, required=True, help="the run directory (new)")
    p.add_argument("overrides", nargs="*", help="train.py overrides (after --)")
    args = p.parse_args()
    if args.world < 2:
        p.error("--world must be at least 2 (one process needs no fake group: use train.py)")
    os.environ.update(rank_zero_env(args.world))  # before the re-execution: it keeps them

    from repro.defense.config import compose
    from repro.defense.process_env import pin_process_environment
    from repro.engine.dist import shutdown
    from repro.engine.loop import train

    cfg = compose(args.overrides, ROOT / "conf")
    pin_process_environment(cfg.determinism)  # strict: re-executes once (PYTHONHASHSEED, ...)
    join_fake_world(cfg)
    summary = train(cfg, args.run_dir)
    shutdown()
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
