"""Issue 34: a rank of a job of several processes lets torch.distributed's worker threads release their last
collectives before Python finalizes (autopar._util.dist.settle_at_exit): a gloo worker that drops a collective's
tensors after finalization began aborted the rank ("terminate called without an active exception")."""

from __future__ import annotations

import threading
import time

import autopar._util.dist as udist


def test_a_process_of_a_job_of_several_registers_the_settle_once(monkeypatch):
    registered = []
    monkeypatch.setattr(udist, "_settle_registered", False)
    monkeypatch.setattr(udist.atexit, "register", registered.append)
    monkeypatch.setattr(udist, "world", lambda: udist.World(size=2, rank=0, local_rank=0, local_size=2))
    monkeypatch.setattr(udist.dist, "is_initialized", lambda: True)  # the user's group: none is made here
    udist.ensure_process_group()
    udist.ensure_process_group()
    assert registered == [udist._settle_collectives]


def test_one_process_registers_nothing(monkeypatch):
    registered = []
    monkeypatch.setattr(udist, "_settle_registered", False)
    monkeypatch.setattr(udist.atexit, "register", registered.append)
    monkeypatch.setattr(udist, "world", lambda: udist.World(size=1, rank=0, local_rank=0, local_size=1))
    udist.ensure_process_group()
    assert registered == []


def test_the_settle_lets_another_thread_run_for_its_time(monkeypatch):
    """While it settles, the main thread holds no GIL: a thread that needs it (as a worker releasing a collective's
    tensors does) runs at once, many times over."""
    monkeypatch.setattr(udist, "EXIT_SETTLE_S", 0.2)
    ran, stop = [], threading.Event()

    def worker():
        while not stop.is_set():
            ran.append(time.perf_counter())
            time.sleep(0.001)

    t = threading.Thread(target=worker, daemon=True)
    start = time.perf_counter()
    t.start()
    udist._settle_collectives()
    took = time.perf_counter() - start
    stop.set()
    t.join()
    assert took >= 0.2 and len(ran) >= 10
