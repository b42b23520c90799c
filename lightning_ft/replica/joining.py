"""How a replica rank joins its job (docs/ARCHITECTURE.md, "The replica layer"; "Warm standby"):
`open_parts` builds its parts (FTAR, the catch-up transport, the gradient buffers, the round
client) after the slow initialization, a warm spare first waiting to be promoted; the leader
then joins (or starts) the job's run in etcd and registers with its coordinator.

Called once, by `Replica.start`, on the training thread."""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Optional

from lightning_ft.coord import keys
from lightning_ft.coord.coordinator import Coordinator
from lightning_ft.coord.membership import MembershipSettings
from lightning_ft.coord.runs import RunHold, open_run
from lightning_ft.coord.etcd_config import store_from_config
from lightning_ft.ftar.engine import FTAR, FTARSettings
from lightning_ft.replica import ledger, startup
from lightning_ft.replica.catchup.transfer import StateTransfer
from lightning_ft.replica.exchange import Exchange
from lightning_ft.replica.rounds import RoundClient
from lightning_ft.replica.state import materialize_optimizer_state
from lightning_ft.secret import tag as secret_tag

if TYPE_CHECKING:
    from lightning_ft.replica.replica import Replica

log = logging.getLogger("lightning_ft.replica")


@dataclass
class Parts:
    """What `Replica.start` opens: the parts a replica rank is made of (composition)."""

    ftar: FTAR
    transfer: StateTransfer
    exchange: Exchange
    rounds: RoundClient
    writer: Optional[ledger.LedgerWriter]
    """The leader's ledger writer (None on other ranks)."""



def open_parts(r: Replica) -> Parts:
    """Open this rank's parts; the leader registers. Returns them (the replica keeps them)."""
    from lightning_ft import ops
    from lightning_ft.network import advertised

    st = r.settings
    startup.mark("setup")
    if r.incarnation > 0 or r.step > 0 or r.who.standby:
        # A restarted replica (or a spare) will almost surely catch up: build its optimizer
        # state now, in the slow init, not on the catch-up's critical path.
        materialize_optimizer_state(r.optimizer)
    if r.is_leader and r._store is None:
        r._store = store_from_config(st.etcd_config, r.who.etcd)
    host = r.group.leader_result(lambda: advertised(st.bind_host, st.advertise_host, r.who.etcd))
    if r.who.standby:
        _await_promotion(r, host)
    ops.set_num_programs(st.num_programs)  # the Triton kernels' grid on GPU (ftar.num_programs)
    ftar = FTAR(r.job, r.rid, r.rank, r.who.secret,
                FTARSettings(chunk_bytes=st.chunk_bytes, num_chunks=st.num_chunks, timeout_s=st.ftar_timeout_s,
                             connect_timeout_s=st.ftar_connect_timeout_s, bind_host=st.bind_host,
                             start_timeout_s=st.hang_timeout_s, transport=st.transport))
    transport = r._catchup_transport(r.who.secret.encode(), st.bind_host, f"r{r.rid}/rank{r.rank}")
    transfer = StateTransfer(transport, r.model, r.optimizer, r._named_params, r.scheduler, r.extras,
                             f"{r.rid}/{r.rank}", fetch_timeout_s=st.ftar_timeout_s * 2)
    mine = (_with_host(ftar.address, host), _with_host(transport.address, host))
    addrs = r.group.gather(mine)
    opts = r.optimizer.optimizers if r.multi else [r.optimizer]
    exchange = Exchange(ftar, opts, r.rid, r.rank, st.hang_timeout_s, st.hang_report_after_s)
    rounds = RoundClient(r.rid, r.group, ftar, r.digests, transfer, [a for a, _ in addrs], st, r.R)
    opened: list = []

    def register() -> tuple[str, int, int]:  # the leader's; its result (or error) on every rank
        opened.extend(_register(r, rounds, addrs))
        return r.root, r.gen, r.cursor

    r.root, gen, cursor = r.group.leader_result(register)
    r.state = replace(r.state, gen=gen, cursor=cursor)
    writer = None
    if opened:
        coord, writer = opened
        rounds.coord, rounds.writer, exchange.coord = coord, writer, coord
    startup.mark("registered")
    return Parts(ftar, transfer, exchange, rounds, writer)


def _register(r: Replica, rounds: RoundClient, addrs: list) -> tuple[Coordinator, ledger.LedgerWriter]:
    """Leader: join (or start) the job's run, then register with the coordinator."""
    st = r.settings
    hold = RunHold(r.store, ttl_s=30.0, keepalive=False)  # until our members/ key exists
    try:
        run = open_run(r.store, st.prefix, r.job, secret_tag(r.who.secret, r.job), hold,
                       want=r.who.run_id, first=r.incarnation == 0)
        log.info("replica %d: %s", r.rid, run.reason)
        r.who = replace(r.who, run_id=run.run_id)
        r.root = keys.root(st.prefix, r.job, run.run_id)
        coord = Coordinator(r.store, r.job, r.rid, r.incarnation, r.spec,
                            MembershipSettings(prefix=st.prefix, lease_ttl_s=st.lease_ttl_s,
                                               hang_timeout_s=st.hang_timeout_s, poll_interval_s=st.poll_interval_s),
                            run=run.run_id, on_failure=lambda rid, reason: rounds.abort_ring(f"replica {rid} {reason}"),
                            on_event=r.event)
        # A new process holds an initial state or the resume's checkpoint: both belong to the
        # ledger's newest generation.
        gen = ledger.latest_gen(r.store, r.root)
        r.state = replace(r.state, gen=gen, cursor=ledger.read_cursor(r.store, r.root, r.rid, gen))
        coord.register(r.step, addrs=[a for a, _ in addrs], state_addrs=[s for _, s in addrs],
                       gen=r.gen, synced=r.synced, cursor=r.cursor)
    finally:
        hold.close()
    return coord, ledger.LedgerWriter(r.store, r.root, r.rid, coord.fence)


def _await_promotion(r: Replica, host: str, slice_s: float = 5.0) -> None:
    """A spare: wait (warm) until promoted, then become that replica's incarnation. The leader
    waits in etcd; with W ranks it hands the outcome on every `slice_s` (None: still waiting),
    so the replica's process group never sits in one collective for hours."""
    from lightning_ft.coord.standby import Waiter, WaiterSettings

    st = r.settings
    waiter = None
    if r.is_leader:
        waiter = Waiter(r.store, r.job, secret_tag(r.who.secret, r.job), r.spec.fingerprint, r.who.standby,
                        WaiterSettings(prefix=st.prefix, ttl_s=st.lease_ttl_s), host=host, world=r.world,
                        run_id=r.who.run_id)
    try:
        while True:
            got = r.group.leader_result(lambda: waiter.wait(slice_s if r.world > 1 else None) if waiter else None)
            if got is not None:
                break
    finally:
        if waiter is not None:
            waiter.close()
    log.info("standby %s: promoted to replica %d incarnation %d", r.who.standby, got.rid, got.incarnation)
    r.who = replace(r.who, rid=got.rid, incarnation=got.incarnation, run_id=got.run_id, standby="")
    r.root = keys.root(st.prefix, r.job, got.run_id)
    startup.mark("promoted")


def _with_host(addr: str, host: str | None) -> str:
    """`addr` (host:port of a listener) with the advertised host in place of its bind host."""
    if not host:
        return addr
    _, _, port = addr.rpartition(":")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
