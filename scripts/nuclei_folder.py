"""Write a generated microscopy-like segmentation folder: non-square grayscale images of
150-260 px whose 12-bit intensities are stored as 16-bit PNGs, and masks of background (0),
nucleus (1) and its 2-pixel boundary (2), 255 (not scored) in a corner of every fourth
image -- the layout ``data=image_mask_folder`` reads (images/ and masks/), for trying
``experiment=segmentation_native`` without data of your own (docs/segmentation.md).

    python scripts/nuclei_folder.py data/nuclei --count 60
"""

from __future__ import annotations

import argparse
from pathlib import Path

from repro.components.data.synthetic import write_nuclei_folder


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("out", type=Path, help="the folder to create (images/ and masks/ inside)")
    p.add_argument("--count", type=int, default=60, help="images (default 60)")
    p.add_argument("--seed", type=int, default=0, help="what they are generated from")
    p.add_argument("--sizes", type=int, nargs=2, default=(150, 260), metavar=("MIN", "MAX"))
    args = p.parse_args()
    files = write_nuclei_folder(args.out, args.count, args.seed, tuple(args.sizes))
    print(f"wrote {len(files)} images and masks into {args.out}")


if __name__ == "__main__":
    main()
