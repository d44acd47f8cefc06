"""Models with one module that is nondeterministic on purpose, for `repro doctor`'s tests.

Each subclasses the default ConvNet (same config keys) and inserts one named module after the
features; everything else is the deterministic ConvNet."""

import torch
from torch import nn

from repro.components.models import ConvNet


class Jitter(nn.Module):
    """Adds noise from a generator seeded from the OS: unseeded randomness."""

    def forward(self, x):
        g = torch.Generator(device=x.device)
        g.seed()
        return x + 1e-3 * torch.randn(x.shape, generator=g, device=x.device, dtype=x.dtype)


class ShuffledSum(nn.Module):
    """Adds the channel sum, summed in an order that changes with every call."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        rolled = x.roll(self.calls, dims=1)
        total = torch.zeros_like(x[:, :1])
        for c in range(rolled.shape[1]):  # sequential float adds: the order shows in the bits
            total = total + rolled[:, c : c + 1]
        return x + total


class UnpoolBlock(nn.Module):
    """Max-pool with indices, then max-unpool: no deterministic kernel (raises in strict)."""

    def __init__(self):
        super().__init__()
        self.pool = nn.MaxPool2d(2, return_indices=True)
        self.unpool = nn.MaxUnpool2d(2)

    def forward(self, x):
        y, idx = self.pool(x)
        return self.unpool(y, idx, output_size=x.shape[-2:])


class UninitializedRead(nn.Module):
    """Adds a buffer it never wrote, as a buggy kernel would. Real leftover memory often
    repeats on a CPU (the allocator hands back the same block), so the leftover is emulated
    by OS-seeded noise wherever PyTorch leaves new memory unfilled; with the NaN fill
    (deterministic algorithms + fill_uninitialized_memory) it reads NaN, every time."""

    def forward(self, x):
        buf = torch.empty_like(x)
        filled = (
            torch.are_deterministic_algorithms_enabled()
            and torch.utils.deterministic.fill_uninitialized_memory
        )
        if not filled:
            g = torch.Generator(device=x.device)
            g.seed()
            buf = torch.rand(x.shape, generator=g, device=x.device, dtype=x.dtype)
        return x + 1e-3 * buf


class _WithExtra(ConvNet):
    extra: type[nn.Module]

    def __init__(self, num_classes, in_channels=3, width=32, dropout=0.1):
        super().__init__(num_classes, in_channels, width, dropout)
        self.suspect = self.extra()

    def forward(self, x):
        x = self.suspect(self.features(x)).mean(dim=(2, 3))
        return self.head(self.dropout(x))


class JitterNet(_WithExtra):
    extra = Jitter


class ShuffledSumNet(_WithExtra):
    extra = ShuffledSum


class UnpoolNet(_WithExtra):
    extra = UnpoolBlock


class IndexAdd(nn.Module):
    """Sums the features into 64 slots with index_add_ (atomics on CUDA: the order of the
    additions varies unless deterministic algorithms are on), and adds a little of it back."""

    def forward(self, x):
        flat = x.reshape(-1)
        index = torch.arange(flat.numel(), device=x.device) % 64
        slots = torch.zeros(64, device=x.device, dtype=x.dtype).index_add_(0, index, flat)
        return x + 1e-3 * slots[index].view_as(x)


class IndexAddNet(_WithExtra):
    extra = IndexAdd


class UninitializedReadNet(_WithExtra):
    extra = UninitializedRead
