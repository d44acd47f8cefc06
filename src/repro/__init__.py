"""repro: bit-exact reproducible PyTorch training (see README.md)."""

__version__ = "0.1.0"
