#!/usr/bin/env python
"""The Lightning peer for the throughput benchmark: the same model, data, global batch,
micro-batches, optimizer and schedule as ``train.py``, trained the way a Lightning user makes
a run "deterministic": ``seed_everything(seed, workers=True)`` + ``Trainer(deterministic=True)``.

    python scripts/lightning_peer.py --steps 300 --warmup 50 -- model=resnet18 amp=on

Needs Lightning 2.x (``pip install -e '.[bench]'``; an optional benchmark dependency, not
the template's). The data loader is a plain shuffling ``DataLoader`` over the micro-batch
size with the same crop/flip drawn from the global RNG (seeded per worker by Lightning), and
``accumulate_grad_batches = K``; the loss is the mean cross-entropy (Lightning divides by K).
Autocast is ``precision="bf16-mixed"`` (``"16-mixed"`` for ``amp.dtype=float16``). Prints one
JSON line: ``images_per_second`` over the steps after ``--warmup`` (device synchronised at
both ends) and the final weights' SHA-256. ``scripts/benchmark.py --lightning`` runs it
beside train.py. Lightning's ``deterministic=True`` leaves PyTorch's NaN fill of new tensors
and cuDNN's TF32 as PyTorch has them (both on).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from repro.components.data import CROP_PAD, IGNORE, DeviceNormalizer, crop_flip_batch
from repro.defense.config import compose
from repro.engine.build import build_data, build_model, build_optimizer, build_schedule, build_task
from repro.engine.settle import uses_channels_last
from repro.records.trace import state_dict_sha256

ROOT = Path(__file__).resolve().parents[1]

try:
    import lightning as L
except ImportError:  # the older package name
    try:
        import pytorch_lightning as L  # type: ignore[no-redef]
    except ImportError:
        sys.exit("lightning_peer.py: needs Lightning 2.x: pip install -e '.[bench]'")


class Augmented(Dataset):
    """The training split with the template's crop/flip, drawn from the global RNG (a
    segmentation mask gets its image's crop and flip)."""

    def __init__(self, split, augment: bool) -> None:
        self.split, self.augment = split, augment

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image, target = (t[0] for t in self.split.fetch(torch.tensor([index])))
        if self.augment:
            # the global RNG, as a typical LightningDataModule's transforms draw
            offsets = torch.randint(0, 2 * CROP_PAD + 1, (2,)).tolist()
            params = torch.tensor([[*offsets, int(torch.randint(0, 2, ()))]])
            image = crop_flip_batch(image[None], params)[0]
            if target.dim() == 2:
                target = crop_flip_batch(target[None, None], params, fill=IGNORE)[0, 0]
        return image, target


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--warmup", type=int, default=50, help="steps left out of the rate")
    p.add_argument("overrides", nargs="*", help="train.py overrides (after --)")
    args = p.parse_args()
    if not 0 < args.warmup < args.steps:
        p.error("need 0 < --warmup < --steps")
    # the schedule of train.py for these steps
    cfg = compose([*args.overrides, f"trainer.max_steps={args.steps}"], ROOT / "conf")
    cuda = str(cfg.device) != "cpu" and torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    t = cfg.trainer
    k = int(t.batch_size) // int(t.micro_batch_size)

    L.seed_everything(int(cfg.seed), workers=True)
    splits = build_data(cfg)
    model = build_model(cfg, splits, torch.device("cpu"))
    channels_last = uses_channels_last(t.channels_last, model, device)  # as the template's
    model = model.to(memory_format=torch.channels_last) if channels_last else model
    task = build_task(cfg, splits)
    workers = int(cfg.loader.num_workers)
    loader = DataLoader(
        Augmented(splits.train, splits.train_pipeline.pipeline is not None),
        batch_size=int(t.micro_batch_size),
        shuffle=True,
        drop_last=True,
        num_workers=workers,
        pin_memory=cuda,
        persistent_workers=workers > 0,
    )
    marks: dict[int, float] = {}

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.normalize: DeviceNormalizer | None = None

        def training_step(self, batch, batch_idx):
            if self.normalize is None:
                self.normalize = DeviceNormalizer(splits, self.device, channels_last)
            images, targets = self.normalize(*batch)
            return task.loss(self.model(images), targets) / len(targets)  # the mean

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            step = self.trainer.global_step
            if step in (args.warmup, args.steps) and step not in marks:
                if cuda:
                    torch.cuda.synchronize()
                marks[step] = time.perf_counter()

        def configure_optimizers(self):
            optimizer = build_optimizer(cfg, self.model)
            schedule = build_schedule(cfg, optimizer)
            return {
                "optimizer": optimizer,
                "lr_scheduler": {"scheduler": schedule, "interval": "step"},
            }

    trainer = L.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=1,
        max_steps=args.steps,
        deterministic=True,
        precision=(
            ("bf16-mixed" if str(cfg.amp.dtype) == "bfloat16" else "16-mixed")
            if bool(cfg.amp.enabled)
            else "32-true"
        ),
        accumulate_grad_batches=k,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    trainer.fit(Module(), train_dataloaders=loader)
    rate = (args.steps - args.warmup) * int(t.batch_size) / (marks[args.steps] - marks[args.warmup])
    print(
        json.dumps(
            {
                "images_per_second": rate,
                "weights_sha256": state_dict_sha256(model.state_dict()),
                "device": str(device),
            }
        )
    )


if __name__ == "__main__":
    main()
