"""The simulator's world (docs/ARCHITECTURE.md, "The simulator"): one thread, a virtual clock, an
event queue, and processes written as generators.

A process is a generator that yields what it waits for:

- a float `dt`: sleep `dt` virtual seconds;
- `(event, timeout)`: wait until `event` (a `SimEvent`) is set, or `timeout` seconds pass; the
  generator receives whether the event was set.

Events fire in time order, and in creation order at the same time, so a run is a function of its
seed: the same seed gives the same trace (`World.trace`, a digest of every event). Nothing here
reads the wall clock or starts a thread.
"""
from __future__ import annotations

import hashlib
import heapq
import random
from typing import Any, Callable, Generator, Optional

Body = Generator[Any, Any, Any]


class SimEvent:
    """threading.Event for one thread on a virtual clock (what coord.Membership waits on)."""

    __slots__ = ("_flag", "_waiters", "_world")

    def __init__(self, world: "World") -> None:
        self._world = world
        self._flag = False
        self._waiters: list[tuple[Proc, int]] = []
        """(process, its resume token when it started waiting): a process the timeout woke first
        has moved on, and its stale entry is ignored."""

    def set(self) -> None:
        self._flag = True
        waiters, self._waiters = self._waiters, []
        for p, token in waiters:
            self._world.after(0.0, self._world._step, p, token, True)

    def clear(self) -> None:
        self._flag = False

    def is_set(self) -> bool:
        return self._flag

    def wait(self, timeout: Optional[float] = None) -> bool:  # pragma: no cover - a process yields instead
        raise RuntimeError("a simulated process waits by yielding (event, timeout), not by blocking")


class Proc:
    """A simulated process (a generator driven by the world)."""

    __slots__ = ("name", "body", "alive", "stopped", "_token", "_parked", "on_exit", "error")

    def __init__(self, name: str, body: Body) -> None:
        self.name, self.body = name, body
        self.alive, self.stopped = True, False
        self._token = 0
        """Bumped at every resume: a stale wake-up (a timeout after the event fired) is ignored."""
        self._parked: Optional[tuple[bool]] = None
        """A wake-up that arrived while stopped (SIGSTOP): delivered at `cont`."""
        self.on_exit: Optional[Callable[["Proc"], None]] = None
        self.error: Optional[BaseException] = None
        """What ended it, when an exception did."""


SPIN_EVENTS = 200_000
"""Events at one virtual instant beyond which the run is a livelock (a real process would spin)."""


class Livelock(BaseException):
    """Some process kept running without letting virtual time pass. A BaseException, so that no
    handler of the code under test takes it for one of its own failures: it ends the run, and the
    job reports it as a liveness violation."""


def _who(args: tuple) -> str:
    proc = next((a for a in args if isinstance(a, Proc)), None)
    return f" for {proc.name}" if proc is not None else ""


class World:
    """The clock, the event queue and the processes of one simulation."""

    def __init__(self, seed: int, trace: bool = False) -> None:
        self.now = 0.0
        self.rng = random.Random(seed)
        self._q: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._seq = 0
        self.events = 0
        self._digest = hashlib.blake2b(digest_size=16)
        self.lines: Optional[list[str]] = [] if trace else None
        """With `trace`: every traced line, for reading a failure."""

    # -- the clock ------------------------------------------------------------------------------
    def clock(self) -> float:
        return self.now

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        self._seq += 1
        heapq.heappush(self._q, (max(t, self.now), self._seq, fn, args))

    def after(self, dt: float, fn: Callable[..., None], *args: Any) -> None:
        self.at(self.now + dt, fn, *args)

    def event(self) -> SimEvent:
        return SimEvent(self)

    def note(self, line: str) -> None:
        """Add a line to the trace (its digest says whether two runs did the same)."""
        self._digest.update(f"{self.now:.6f} {line}\n".encode())
        if self.lines is not None:
            self.lines.append(f"{self.now:10.4f} {line}")

    @property
    def trace(self) -> str:
        return self._digest.hexdigest()

    # -- processes ------------------------------------------------------------------------------
    def spawn(self, name: str, body: Body, delay: float = 0.0) -> Proc:
        p = Proc(name, body)
        self.after(delay, self._step, p, p._token, None)
        return p

    def kill(self, p: Proc) -> None:
        """SIGKILL: the process ends where it is (its `finally` blocks do not run: a killed
        process cleans nothing up)."""
        if not p.alive:
            return
        p.alive = False
        p._token += 1
        if p.on_exit is not None:
            p.on_exit(p)

    def stop(self, p: Proc) -> None:
        """SIGSTOP: nothing of it runs until `cont`."""
        p.stopped = True

    def cont(self, p: Proc) -> None:
        if not p.stopped:
            return
        p.stopped = False
        if p._parked is not None and p.alive:
            (value,) = p._parked
            p._parked = None
            self.after(0.0, self._step, p, p._token, value)

    def _step(self, p: Proc, token: int, value: Any) -> None:
        if not p.alive or token != p._token:
            return
        if p.stopped:
            p._parked = (value,)
            return
        p._token += 1
        try:
            req = p.body.send(value)
        except StopIteration:
            p.alive = False
            if p.on_exit is not None:
                p.on_exit(p)
            return
        except Exception as e:  # the process ended by an exception: its owner reads `error`
            p.alive, p.error = False, e
            if p.on_exit is not None:
                p.on_exit(p)
            return
        if isinstance(req, tuple):
            ev, timeout = req
            if ev.is_set():
                self.after(0.0, self._step, p, p._token, True)
                return
            ev._waiters.append((p, p._token))
            if timeout is not None:
                self.after(timeout, self._step, p, p._token, False)
        else:
            self.after(float(req), self._step, p, p._token, None)

    # -- running --------------------------------------------------------------------------------
    def run(self, until: float, stop: Callable[[], bool] = lambda: False) -> None:
        """Run events until virtual time `until`, or until `stop()` says so."""
        q = self._q
        same = 0  # events run at this virtual instant: a process that never lets time pass spins
        while q and not stop():
            t, _, fn, args = q[0]
            if t > until:
                break
            heapq.heappop(q)
            same = same + 1 if t == self.now else 0
            if same > SPIN_EVENTS:
                raise Livelock(f"t={t:.3f}: {SPIN_EVENTS} events without the clock moving (a busy loop: "
                               f"the last one ran {getattr(fn, '__qualname__', fn)}{_who(args)})")
            self.now = t
            self.events += 1
            fn(*args)
        if not q or q[0][0] > until:
            self.now = max(self.now, until) if not stop() else self.now
