"""The collector during start-up (megatron_dynamo/heap.py): the survivors of a full collection are frozen, garbage is
still collected, and nothing stays installed afterwards."""

import gc

from megatron_dynamo import heap


class Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the collector frees it


def test_start_up_freezes_survivors_and_still_collects_garbage():
    gc.collect()
    callbacks = list(gc.callbacks)
    try:
        with heap.start_up():
            entered = gc.get_freeze_count()
            assert entered > 0  # the heap at entry (this test's imports) is frozen
            kept = [Node() for _ in range(1000)]
            garbage = [Node() for _ in range(1000)]
            del garbage
            assert gc.collect() >= 1000  # the cycles dropped are collected, frozen or not
            assert gc.get_freeze_count() >= entered + 1000  # the survivors are frozen: the next walk skips them
            with heap.start_up():  # nested: one
                assert len(gc.callbacks) == len(callbacks) + 1
        assert gc.callbacks == callbacks
        frozen = gc.get_freeze_count()
        more = [Node() for _ in range(100)]
        gc.collect()
        assert gc.get_freeze_count() == frozen  # after the start-up, a full collection freezes nothing
        assert len(kept) == 1000 and len(more) == 100
    finally:
        gc.unfreeze()


def test_the_heap_is_unfrozen_at_exit():
    """Frozen objects are never collected: at exit they are unfrozen, so the interpreter's last collections free them
    (triton's extension otherwise reports its live instances as leaked on stderr, after a one-line error)."""
    import subprocess
    import sys

    script = ("import atexit, gc\n"
              "atexit.register(lambda: print('frozen at exit', gc.get_freeze_count()))\n"  # runs last (LIFO)
              "from megatron_dynamo import heap\n"
              "with heap.start_up():\n"
              "    pass\n"
              "with heap.start_up():\n"
              "    assert gc.get_freeze_count() > 0\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "frozen at exit 0"
