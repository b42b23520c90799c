"""The strategy's own error (re-exported by strategy/ft_hsdp.py)."""
from __future__ import annotations


class FTHSDPError(RuntimeError):
    """A misuse or an unrecoverable state, with what to do about it."""
