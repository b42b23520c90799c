"""lightning-ft: fault-tolerant HSDP (FT-HSDP) for PyTorch Lightning.

See DESIGN.md in the project's shared notes and README.md for the architecture.
"""
__version__ = "0.1.0"
