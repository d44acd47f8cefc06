"""Keyed randomness (docs/design.md, principle 1).

Every random draw of the pipeline is a pure function of ``(seed, purpose, counters...)``.
Nothing is streamed from a global generator, so nothing has to be carried across
loader workers, processes or restarts: the worker count, the world size and the resume
point cannot change which numbers are drawn.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import torch

_SEED_BITS = 63  # torch.Generator.manual_seed takes any 64-bit value; 63 keeps it positive.


def derive_seed(seed: int, purpose: str, *counters: int) -> int:
    """A 63-bit seed that depends only on ``seed``, ``purpose`` and ``counters``.

    blake2b over an unambiguous encoding of the tuple: stable across processes, platforms
    and Python versions (unlike ``hash()``), and unrelated seeds for neighbouring inputs.
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    parts = [str(int(seed)), purpose, *(str(int(c)) for c in counters)]
    # Length-prefix every part so ("ab", 1) and ("a", "b1") can never collide.
    payload = "".join(f"{len(p)}:{p};" for p in parts).encode()
    digest = hashlib.blake2b(payload, digest_size=8, person=b"repro.rng.v1").digest()
    return int.from_bytes(digest, "little") >> (64 - _SEED_BITS)


def keyed_generator(
    seed: int, purpose: str, *counters: int, device: str | torch.device = "cpu"
) -> torch.Generator:
    """A fresh ``torch.Generator`` seeded with ``derive_seed(seed, purpose, *counters)``."""
    generator = torch.Generator(device=device)
    generator.manual_seed(derive_seed(seed, purpose, *counters))
    return generator


def keyed_permutation(n: int, seed: int, purpose: str, *counters: int) -> torch.Tensor:
    """A permutation of ``range(n)`` keyed by ``(seed, purpose, counters)`` (always on the CPU)."""
    return torch.randperm(n, generator=keyed_generator(seed, purpose, *counters))


_M32 = 0xFFFFFFFF


def _mul32(x, c: int):
    """``x * c mod 2**32`` for ``x`` in [0, 2**32) (an int, or an int64 tensor): in 16-bit
    halves of ``c``, so that no product leaves int64's range (exact on every device)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x):
    """A bijection of 32-bit values whose output bits each depend on every input bit (the
    "lowbias32" integer hash: xor-shift, multiply, xor-shift, multiply, xor-shift)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def keyed_draws(seed: int, purpose: str, *counters: torch.Tensor, draws: int) -> torch.Tensor:
    """``draws`` 32-bit values (int64, in [0, 2**32)) for every element of the int64 counter
    tensors (broadcast; each counter in [0, 2**32)), keyed by ``(seed, purpose, *counters)``:
    shape ``(*counters' shape, draws)``, on the counters' device.

    A counter-based generator: a pure integer function of the key, computed elementwise,
    so a whole batch's draws are a few tensor ops on the batch's device, with the same
    values on a CPU and a GPU, in any batch and any process."""
    key = derive_seed(seed, purpose)
    state = _mix32((key & _M32) ^ _mix32(key >> 32))  # a Python int
    for counter in counters:
        state = _mix32(state ^ (counter & _M32))
    offsets = [(0x9E3779B9 * (j + 1)) & _M32 for j in range(draws)]
    offsets = torch.tensor(offsets, dtype=torch.int64, device=counters[0].device)
    return _mix32((state[..., None] + offsets) & _M32)


def seed_global_rngs(seed: int) -> dict[str, int]:
    """Seed Python's ``random``, NumPy's legacy global RNG and torch's CPU and CUDA generators.

    The pipeline never draws from these (everything is keyed); they are a safety net for
    third-party code that does. Each gets its own derived seed. Returns what was set.
    """
    seeds = {
        "python_random": derive_seed(seed, "global", 0),
        "numpy_global": derive_seed(seed, "global", 1) % 2**32,  # legacy API takes 32 bits
        "torch": derive_seed(seed, "global", 2),
    }
    random.seed(seeds["python_random"])
    np.random.seed(seeds["numpy_global"])
    torch.manual_seed(seeds["torch"])  # seeds the CPU and every CUDA generator
    return seeds


def seed_forward(device: torch.device, seed: int, step: int, micro_batch: int) -> None:
    """Re-seed the generator that dropout and friends draw from, right before a forward.

    Keyed by ``(seed, "forward", step, micro_batch)``: whoever computes micro-batch k of
    step s draws the same masks.
    """
    value = derive_seed(seed, "forward", step, micro_batch)
    if device.type == "cuda":
        torch.cuda.default_generators[device.index or 0].manual_seed(value)
    else:
        torch.default_generator.manual_seed(value)


def worker_init_fn(worker_id: int) -> None:
    """Seed NumPy and ``random`` inside a DataLoader worker from the worker's torch seed.

    The pipeline's own augmentation is keyed per sample and ignores these; this only keeps
    third-party transforms that use the global NumPy/``random`` state from repeating or
    sharing streams across workers. ``torch.initial_seed()`` in a worker is the loader's
    base seed + worker id, and the base seed comes from the loader's keyed generator.
    """
    del worker_id  # already folded into torch.initial_seed()
    worker_seed = torch.initial_seed()
    random.seed(worker_seed)
    np.random.seed(worker_seed % 2**32)


def global_rng_states() -> dict[str, Any]:
    """The global generators' states as plain data (lists and tensors), so that a checkpoint
    holding them loads with ``torch.load(weights_only=True)``."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python_random": [version, list(internal), gauss],
        "numpy_global": {
            "kind": str(kind),
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_global_rng_states(states: dict[str, Any]) -> None:
    """Restore what :func:`global_rng_states` returned."""
    version, internal, gauss = states["python_random"]
    random.setstate((version, tuple(internal), gauss))
    n = states["numpy_global"]
    np.random.set_state(
        (
            n["kind"],
            n["keys"].numpy().astype(np.uint32),
            n["pos"],
            n["has_gauss"],
            n["cached_gaussian"],
        )
    )
    torch.set_rng_state(states["torch_cpu"])
    cuda = states.get("torch_cuda") or []
    if cuda and torch.cuda.is_available():
        for i, state in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(state, i)
