#!/usr/bin/env python
"""The peer for the world-size benchmark: plain ``DistributedDataParallel`` on the same model,
data, global batch and micro-batches as ``train.py``, in a lean loop.

    torchrun --standalone --nproc_per_node=2 scripts/ddp_peer.py --steps 60 -- trainer.batch_size=64

Each rank computes its share of the K micro-batches (the same keyed sampler and
augmentation), accumulating gradients locally under ``no_sync()``; the last micro-batch's
backward lets DDP all-reduce the gradients in buckets, overlapped with the backward pass
(DDP averages over ranks, so the loss is scaled by the world size to get the sum). No trace,
no logs, no checkpoints: it gives DDP every advantage. Rank 0 prints one JSON line:
``steady_images_per_second`` (after the first 10 steps, device synchronised) and the final
weights' SHA-256. ``scripts/dist_benchmark.py --ddp`` runs it beside train.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from repro.base.rng import seed_forward
from repro.base.world import device_for, launched_world
from repro.components.data import DeviceNormalizer, loading
from repro.defense.config import compose
from repro.defense.determinism import apply_determinism
from repro.engine.build import (
    Precision,
    build_data,
    build_loader,
    build_model,
    build_optimizer,
    build_schedule,
    build_task,
)
from repro.engine.reduction import check_split, share
from repro.engine.settle import uses_channels_last
from repro.records.trace import state_dict_sha256

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("overrides", nargs="*", help="train.py overrides (after --)")
    args = p.parse_args()
    # the schedule of train.py for these steps
    cfg = compose([*args.overrides, f"trainer.max_steps={args.steps}"], ROOT / "conf")
    world = launched_world()
    device = device_for(str(cfg.device), world)
    if device.type == "cuda":
        if device.index is None:  # `device=cuda` in one process: DDP wants an index
            device = torch.device("cuda", world.local_rank)
        torch.cuda.set_device(device)
        # the NCCL settings train.py pins for this mode (strict: Ring/Simple, NVLS off), so the
        # all-reduce runs under the same rules as train.py's
        os.environ.update(dict(cfg.determinism.nccl_env))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    apply_determinism(cfg, device)
    t = cfg.trainer
    k = int(t.batch_size) // int(t.micro_batch_size)
    check_split(k, world)
    first, count = share(k, world)
    splits = build_data(cfg)
    model = build_model(cfg, splits, device)
    task = build_task(cfg, splits)
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None
    )
    optimizer = build_optimizer(cfg, model)
    schedule = build_schedule(cfg, optimizer)
    loader = build_loader(cfg, splits, device, shard=(first, count))
    channels_last = uses_channels_last(t.channels_last, model, device)  # as the template's
    normalize = DeviceNormalizer(splits, device, channels_last)
    precision = Precision(cfg.amp, device)
    with loading(loader) as batches:  # its workers stopped on the way out, error or not
        warm, marks = 10, {}
        for step in range(args.steps):
            for j in range(count):
                images, labels = normalize(*next(batches))
                seed_forward(device, int(cfg.seed), step, first + j)
                sync = contextlib.nullcontext() if j == count - 1 else ddp.no_sync()
                with sync:
                    with precision.autocast():
                        logits = ddp(images)
                    loss = task.loss(logits, labels)  # summed over the micro-batch, as train.py's
                    (loss * world.size / int(t.batch_size)).backward()
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            if step + 1 in (warm, args.steps):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                marks[step + 1] = time.perf_counter()
    rate = (args.steps - warm) * int(t.batch_size) / (marks[args.steps] - marks[warm])
    if world.main:
        weights = state_dict_sha256(model.state_dict())
        print(json.dumps({"steady_images_per_second": rate, "weights_sha256": weights}))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as train.py does under torchrun: skip the C++ teardown that can abort


if __name__ == "__main__":
    main()
