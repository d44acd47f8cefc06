"""The loop an expert writes by hand, as the peer of the template's strict mode on one GPU.

The same model class, optimizer, schedule, loss (the task's: cross-entropy, or the
segmentation task's cross-entropy + soft Dice), precision and batch as the template's
config, built by the template's own builders; the training split on the device, and:

- a random crop and flip per sample drawn there (one gather, as the template's; a mask
  moves with its image), or nothing with ``augment=none``;
- for images of their own sizes (``experiment=segmentation_native``) a random patch per
  sample, flipped, turned and intensity-scaled, cut on the GPU in one gather
  (:class:`NativePatches`: what the template's ``augment=patches`` does on the host);

deterministic algorithms on, channels_last on a GPU (as the template's ``auto``) and
optionally ``torch.compile`` (Inductor's deterministic mode on); on the CPU, the config's
``determinism.cpu_threads``. Nothing else: no trace, no checkpoints, no keyed randomness, no
evaluation, no check for a loss that is not finite. ``scripts/benchmark.py --reference``
runs it beside the template on a GPU, ``scripts/step_overhead.py`` on the CPU; its weights
digest shows it repeats too.

    python scripts/reference_loop.py --steps 3000 --device cpu -- model.width=2 augment=none
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from repro.components.data import CROP_PAD, IGNORE, crop_flip_batch
from repro.defense.config import compose
from repro.engine.build import build_data, build_model, build_optimizer, build_schedule, build_task
from repro.records.trace import state_dict_sha256

ROOT = Path(__file__).resolve().parents[1]


def reference_run(
    overrides: list[str],
    steps: int,
    warmup: int,
    compiled: bool,
    device: str = "cuda",
    after_step: Callable[[int, torch.nn.Module], None] | None = None,
) -> dict:
    """Train ``steps`` steps; images/s over those after ``warmup`` (CUDA-synchronised).
    ``after_step(step, model)``, as :func:`repro.engine.loop.train` calls it (the profiler's)."""
    cfg = compose([*overrides, "trainer.compile=off", "trainer.channels_last=false"], ROOT / "conf")
    device = torch.device(device)
    on_cuda = device.type == "cuda"
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    if not on_cuda:
        torch.set_num_threads(int(cfg.determinism.cpu_threads))
    torch.manual_seed(int(cfg.seed))
    splits = build_data(cfg)
    layout = torch.channels_last if on_cuda else torch.contiguous_format  # as channels_last=auto
    model = build_model(cfg, splits, device).to(memory_format=layout)
    if compiled:
        import torch._inductor.config as inductor

        inductor.deterministic = True
        model.compile(dynamic=False)
    task = build_task(cfg, splits)
    optimizer = build_optimizer(cfg, model)
    schedule = build_schedule(cfg, optimizer)
    mean, std = (torch.tensor(v, device=device).view(1, -1, 1, 1) for v in splits.normalisation())
    batch, micro = int(cfg.trainer.batch_size), int(cfg.trainer.micro_batch_size)
    bf16 = bool(cfg.amp.enabled)
    augmented = not str(cfg.augment.train._target_).endswith(".Resize")  # augment=none: as loaded
    generator = torch.Generator(device).manual_seed(int(cfg.seed))
    native = isinstance(splits.train.images, list)  # images of their own sizes: patches
    if native:
        patches = NativePatches(splits.train, int(cfg.data.image_size), device, generator)
    else:
        images, labels = splits.train.images.to(device), splits.train.labels.to(device)
    marks = {}
    for step in range(1, steps + 1):
        if native:
            x, y = patches.batch(batch)
        else:
            index = torch.randint(0, len(images), (batch,), device=device, generator=generator)
            x, y = images[index], labels[index]
        if augmented and not native:
            offsets = torch.randint(
                0, 2 * CROP_PAD + 1, (batch, 2), device=device, generator=generator
            )
            flips = torch.randint(0, 2, (batch, 1), device=device, generator=generator)
            params = torch.cat([offsets, flips], 1)
            x = crop_flip_batch(x, params)
            if y.dim() == 3:  # masks: the image's crop and flip, the border not scored
                y = crop_flip_batch(y[:, None], params, fill=IGNORE)[:, 0]
        x = x.float() / 255 if x.dtype == torch.uint8 else x  # float32: mapped when read
        x = ((x - mean) / std).contiguous(memory_format=layout)
        for k in range(0, batch, micro):  # gradient accumulation, as the template's K
            with torch.autocast(device.type, torch.bfloat16, enabled=bf16):
                out = model(x[k : k + micro])
            loss = task.loss(out.float(), y[k : k + micro].long()) / batch  # the sum, over B
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        if after_step is not None:
            after_step(step, model)
        if step in (warmup, steps):
            if on_cuda:
                torch.cuda.synchronize()
            marks[step] = time.perf_counter()
    return {
        "images_per_second": (steps - warmup) * batch / (marks[steps] - marks[warmup]),
        "weights": state_dict_sha256(model.state_dict()),
    }


class NativePatches:
    """``augment=patches`` by hand, on the GPU: the split's images of their own sizes padded
    into one tensor there (masks with IGNORE), and per step one gather that cuts every
    sample's ``size`` x ``size`` patch at a drawn place, flipped both ways and turned by a
    drawn multiple of 90 degrees (index arithmetic), then brightness and contrast scaled --
    the work ``RandomPatch`` does per sample on the host, as one would write it for the GPU."""

    def __init__(self, split, size: int, device: torch.device, generator: torch.Generator):
        images, masks = split.fetch(torch.arange(len(split)))  # every sample, read (mapped)
        h, w = max(int(i.shape[-2]) for i in images), max(int(i.shape[-1]) for i in images)
        n, c = len(images), int(images[0].shape[0])
        self.images = torch.zeros((n, c, h, w), dtype=images[0].dtype, device=device)
        self.masks = torch.full((n, h, w), IGNORE, dtype=torch.int64, device=device)
        self.sizes = torch.tensor([tuple(i.shape[-2:]) for i in images], device=device)
        for k, (image, mask) in enumerate(zip(images, masks, strict=True)):
            self.images[k, :, : image.shape[-2], : image.shape[-1]] = image.to(device)
            self.masks[k, : mask.shape[-2], : mask.shape[-1]] = mask.to(device)
        self.size, self.generator, self.device = size, generator, device
        self.grid = torch.arange(size, device=device)

    def batch(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        g, s, dev = self.generator, self.size, self.device
        index = torch.randint(0, len(self.images), (b,), device=dev, generator=g)
        room = (self.sizes[index] - s).clamp(min=0) + 1
        origin = (torch.rand((b, 2), device=dev, generator=g) * room).long()
        i, j = self.grid.view(1, s, 1).expand(b, s, s), self.grid.view(1, 1, s).expand(b, s, s)
        flips = torch.rand((b, 2), device=dev, generator=g) < 0.5
        i = torch.where(flips[:, :1, None], s - 1 - i, i)
        j = torch.where(flips[:, 1:, None], s - 1 - j, j)
        turns = torch.randint(0, 4, (b, 1, 1), device=dev, generator=g)
        for k in range(1, 4):  # a turn by 90 degrees k times: where the output reads from
            i, j = torch.where(turns >= k, j, i), torch.where(turns >= k, s - 1 - i, j)
        rows, cols = origin[:, :1, None] + i, origin[:, 1:, None] + j
        at = index.view(b, 1, 1)
        x = self.images[at, :, rows, cols].permute(0, 3, 1, 2)  # one gather: b x c x s x s
        y = self.masks[at, rows, cols]
        factors = 1 + 0.1 * (2 * torch.rand((b, 2, 1, 1, 1), device=dev, generator=g) - 1)
        x = x.float() * factors[:, 0]
        centre = x.mean(dim=(1, 2, 3), keepdim=True)
        return (x - centre) * factors[:, 1] + centre, y


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=10, help="steps before the timed ones")
    p.add_argument("--device", default="cuda")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("overrides", nargs="*", help="train.py overrides (after --)")
    args = p.parse_args()
    if not 0 < args.warmup < args.steps:
        p.error("--warmup must be at least 1 and below --steps")
    result = reference_run(args.overrides, args.steps, args.warmup, args.compile, args.device)
    print(json.dumps(result))  # the last line: one JSON object (scripts/_results.run_json)


if __name__ == "__main__":
    main()
