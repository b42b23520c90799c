"""The simulator's network (docs/ARCHITECTURE.md, "The simulator"): FTAR rings, catch-up
transfers and checkpoints, as models on the world's clock.

- `Net.exchange`: one all-reduce of a ring (epoch, step) completes when every member submitted
  and no link of the ring is cut; a member waits for its peers (at most the hang timeout for a
  first chunk), and fails at once when the ring is aborted (a member's failure, a leader going to
  a full round) or a member dies (its sockets close). A cut link delivering the last chunk fails
  only the member behind it: a partial completion, some commit and some do not.
- `SimFTAR`: what the round client (replica/rounds.py) asks of FTAR (`join`, `abort`,
  `abort_peer`, `broken`), per replica incarnation.
- `Net.fetch`: a catch-up of a published state version from a live source; a source that dies
  while its bytes flow leaves the fetcher's state partly written (LOST).
- `Checkpoints`: the job's persistent checkpoints (their records go to etcd as the real ones do).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generator, Optional

from lightning_ft.ftar.transport.base import RecoverableError
from lightning_ft.replica.plan import FAILED, LOST, OK
from lightning_ft.sim.world import SimEvent, World


@dataclass(frozen=True)
class ModelState:
    """A replica's training state in the simulation: an exact function of what it trained (a hash
    chain over each applied step's batches and LR factor), so that identical replicas and
    exactly-once can be checked exactly."""

    step: int = 0
    digest: int = 0
    batches: int = 0
    """Committed batches (one optimizer: equal to `step`)."""
    tainted: bool = False
    """Silently corrupted (a fault), or derived from a corrupted state (applied on it, or fetched
    from it before the divergence guard saw it): not the job's history, whatever its digest."""

    def applied(self, step: int, trained: tuple, lr_factor: float) -> "ModelState":
        return ModelState(step + 1, hash((self.digest, step, trained, round(lr_factor, 12))) & (2 ** 63 - 1),
                          self.batches + 1, self.tainted)


@dataclass
class Exchange:
    """One all-reduce of one ring."""

    members: tuple[tuple[int, int], ...]
    """(rid, incarnation) of each member, in ring order."""
    subs: dict[int, tuple] = field(default_factory=dict)
    """rid -> what it trained (empty: zeros)."""
    done: Optional[SimEvent] = None
    result: Optional[tuple] = None
    failed: dict[int, tuple[str, int]] = field(default_factory=dict)
    """rid -> (why its exchange failed, the replica it blames or -1); a whole-ring failure lists
    every member."""
    started: float = 0.0


class Net:
    """Rings, transfers and link cuts of one simulated job."""

    def __init__(self, world: World, xfer_s: float = 0.002, fetch_s: float = 0.005) -> None:
        self.world = world
        self.xfer_s, self.fetch_s = xfer_s, fetch_s
        self.exchanges: dict[tuple[int, int], Exchange] = {}
        self.cut: dict[int, float] = {}
        """rid -> until when its FTAR links are cut (etcd still reaches it)."""
        self.alive: dict[tuple[int, int], bool] = {}
        """(rid, incarnation) -> whether that process lives."""
        self.published: dict[tuple[int, int], dict[int, ModelState]] = {}
        """(rid, incarnation) -> version -> the state it serves."""
        self.closed: set[tuple[int, int]] = set()
        """(rid, epoch): links a member closed by an abort (its ring of that epoch is gone)."""

    def is_cut(self, rid: int) -> bool:
        return self.cut.get(rid, -1.0) > self.world.now

    # -- the ring -----------------------------------------------------------------------------------
    def submit(self, rid: int, epoch: int, step: int, members: tuple[tuple[int, int], ...], trained: tuple,
               ftar: "SimFTAR") -> Optional[Exchange]:
        """Member `rid` sends its part of the all-reduce of ring `epoch` at `step` (None: its ring
        is not connected, the exchange fails at once)."""
        if ftar.broken or ftar.epoch != epoch or any((m, epoch) in self.closed for m, _ in members):
            return None
        key = (epoch, step)
        ex = self.exchanges.get(key)
        if ex is None or ex.members != members or ex.result is not None or rid in ex.subs:
            ex = self.exchanges[key] = Exchange(members, done=self.world.event(), started=self.world.now)
            while len(self.exchanges) > 256:
                del self.exchanges[next(iter(self.exchanges))]
        ex.subs[rid] = trained
        ftar.current = ex
        if len(ex.subs) == len(members) and not ex.failed:
            self.world.after(self.xfer_s, self._complete, key, ex)
        return ex

    def wait(self, rid: int, ex: Optional[Exchange], ftar: "SimFTAR", first_chunk_s: float
             ) -> Generator[Any, Any, tuple[int, Optional[tuple], tuple[str, int]]]:
        """Wait for the exchange: (OK, the sum, ("", -1)) or (FAILED, None, (why, the replica to blame
        or -1)). A member waits for its peers' first chunks at most `first_chunk_s`."""
        if ex is None:
            return FAILED, None, ("not connected: the ring was aborted or not joined", -1)
        assert ex.done is not None
        deadline = self.world.now + first_chunk_s
        while ex.result is None and rid not in ex.failed:
            left = deadline - self.world.now
            if left <= 0:  # it gives up and closes its links: the ring fails for everyone
                late = [r for r, _ in ex.members if r not in ex.subs]
                self._fail(ex, "timed out waiting for a chunk", [r for r, _ in ex.members], late[0] if late else -1)
                break
            yield ex.done, left
        ftar.current = None
        if rid in ex.failed:
            return FAILED, None, ex.failed[rid]
        return OK, ex.result, ("", -1)

    def _complete(self, key: tuple[int, int], ex: Exchange) -> None:
        if ex.result is not None or ex.failed:
            return
        cut = [r for r, _ in ex.members if self.is_cut(r)]
        dead = [r for r, i in ex.members if not self.alive.get((r, i))]
        if cut or dead:
            # a cut or a dead member stops the ring before the sum goes round; a cut that lands
            # on the last chunk fails only the member behind it (a partial completion)
            late = self.world.rng.random() < 0.25 and not dead
            culprit = (cut or dead)[0]
            self._fail(ex, f"link of replica {culprit} failed", cut if late else [r for r, _ in ex.members], culprit)
            if not late:
                return
        ex.result = tuple(sorted(b for t in ex.subs.values() for b in t))
        assert ex.done is not None
        ex.done.set()

    def _fail(self, ex: Exchange, why: str, who: list[int], culprit: int = -1) -> None:
        for m in who:
            ex.failed.setdefault(m, (why, culprit if culprit != m else -1))
        assert ex.done is not None
        ex.done.set()

    def abort(self, rid: int, epoch: int, why: str) -> None:
        """Member `rid` aborts: it closes its links of ring `epoch`, so every exchange of that ring
        fails, the one in flight at once and any later one as it starts (the others see closed
        links, close theirs in turn, and rebuild the ring in their next round)."""
        self.closed.add((rid, epoch))
        for (e, _), ex in self.exchanges.items():
            if e == epoch and ex.result is None and any(m == rid for m, _ in ex.members):
                self._fail(ex, why, [r for r, _ in ex.members], rid)

    def died(self, rid: int, inc: int) -> None:
        """A process died: its sockets close, the exchanges it was in fail for everyone."""
        self.alive[(rid, inc)] = False
        self.published.pop((rid, inc), None)
        for ex in self.exchanges.values():
            if (rid, inc) in ex.members and ex.result is None and not ex.failed:
                self._fail(ex, f"connection to replica {rid} lost", [r for r, _ in ex.members], rid)

    # -- catch-up -----------------------------------------------------------------------------------
    def publish(self, rid: int, inc: int, version: int, state: ModelState) -> None:
        served = self.published.setdefault((rid, inc), {})
        served.clear()  # a server holds one publication (replica/catchup/server.py)
        served[version] = state

    def fetch(self, src: tuple[int, int], version: int, deadline_s: float
              ) -> Generator[Any, Any, tuple[int, Optional[ModelState]]]:
        """Fetch `version` of `src`'s state: (OK, state), (FAILED, None) when nothing was written,
        (LOST, None) when the source died while its bytes flowed."""
        end = self.world.now + deadline_s
        while True:
            if not self.alive.get(src) or self.is_cut(src[0]):
                return FAILED, None
            got = self.published.get(src, {}).get(version)
            if got is not None:
                break
            if self.world.now >= end:
                return FAILED, None
            yield 0.002  # not yet published: the source publishes right after its quorum
        yield self.fetch_s
        if not self.alive.get(src):
            return LOST, None  # its bytes stopped midway
        return OK, got


class SimFTAR:
    """FTAR as the round client sees it (replica/rounds.py), for one replica incarnation."""

    def __init__(self, net: Net, rid: int) -> None:
        self.net, self.rid = net, rid
        self.epoch = -1
        self.broken = False
        self.timeout_s = 1.0
        self.current: Optional[Exchange] = None
        """The exchange this member is in (an abort fails it)."""

    def join(self, epoch: int, n: int, index: int, left: str, right: str) -> float:
        if self.net.is_cut(self.rid):
            raise RecoverableError(left, f"timed out waiting for the left neighbour to connect for epoch {epoch}")
        self.epoch, self.broken = epoch, False
        return 0.0

    def abort(self, reason: str) -> None:
        self.broken = True
        self.net.abort(self.rid, self.epoch, reason)

    def abort_peer(self, address: str, reason: str, epoch: int, timeout_s: float = 1.0) -> None:
        pass  # one rank per replica in the simulation: nothing to forward
