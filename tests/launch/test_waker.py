"""How the supervision loop sleeps (launch/waker.py): until notified (any thread, a signal
handler), until a descriptor turns readable (a child's pidfd), or the timeout."""
from __future__ import annotations

import os
import threading
import time

from lightning_ft.launch.waker import Waker


def test_a_notify_from_another_thread_ends_the_sleep_at_once():
    w = Waker()
    threading.Timer(0.1, w.notify).start()
    t0 = time.monotonic()
    w.sleep(10.0)
    assert time.monotonic() - t0 < 5.0


def test_a_notify_before_the_sleep_is_not_lost_and_is_drained():
    w = Waker()
    for _ in range(3):
        w.notify()
    t0 = time.monotonic()
    w.sleep(10.0)  # returns at once: the byte was waiting
    assert time.monotonic() - t0 < 5.0
    t0 = time.monotonic()
    w.sleep(0.2)  # drained: this one sleeps its timeout
    assert time.monotonic() - t0 >= 0.15


def test_a_readable_descriptor_ends_the_sleep():
    w = Waker()
    r, wr = os.pipe()
    try:
        threading.Timer(0.1, os.write, args=(wr, b"x")).start()
        t0 = time.monotonic()
        w.sleep(10.0, [r])
        assert time.monotonic() - t0 < 5.0
    finally:
        os.close(r)
        os.close(wr)
