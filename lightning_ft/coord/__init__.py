"""Coordination through etcd (docs/ARCHITECTURE.md, "Keyspace", "The quorum", "etcd")."""
import os

# gRPC's fork handlers can crash a child between fork() and exec() while another thread is
# inside gRPC (seen: an embedded etcd restarted under a live watch exited with -11). Nothing
# we fork (etcd, torchrun, DataLoader workers) uses gRPC, so turn them off unless the user
# chose; this must run before grpc is imported, which every lightning_ft.coord import ensures.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
