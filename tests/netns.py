"""The network-namespace harness lives in the package (lightning_ft/bench/netns.py: the soak
uses it too); the tests import it from here."""
from lightning_ft.bench.netns import TAG_PREFIX, Host, Net, NetError, leftovers, skip_reason  # noqa: F401
