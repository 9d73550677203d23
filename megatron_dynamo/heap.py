"""The garbage collector while a command starts up.

The imports (torch, transformers, Megatron-Core, vLLM) and the models make a heap of millions of objects that live as
long as the process, and the collector's full collections walk all of it, each time the heap has grown by a quarter:
a dozen times while ``dynamo train`` starts, 3 s of a 9 s start on 2 CPU cores. Within :func:`start_up`, the heap
is frozen (``gc.freeze``) as the phase begins and after each full collection, so a full collection walks only what
came after the last one. Frozen objects are never collected again: those of the imports live as long as the process
anyway, and vLLM freezes the whole heap at the end of its own start-up (and unfreezes it when it shuts down). The
garbage of the start-up is collected as before, but for cycles left since the last collection when a phase begins
(a few thousand objects). At exit the heap is unfrozen, so the interpreter's last collections free it as they would
have (extension modules such as triton's report instances still alive then as leaked).
"""

from __future__ import annotations

import atexit
import contextlib
import gc


def _freeze_survivors(phase: str, info: dict) -> None:
    if phase == "stop" and info["generation"] == 2:
        gc.freeze()


@contextlib.contextmanager
def start_up():
    """A start-up phase (imports, building the model and the engine): the survivors of each full collection frozen
    (module docstring). Not for the steps of a run: something alive during one collection and garbage later would
    never be freed. Nested uses are one."""
    if _freeze_survivors in gc.callbacks:
        yield
        return
    gc.freeze()
    gc.callbacks.append(_freeze_survivors)
    atexit.unregister(gc.unfreeze)  # once, however many start-ups
    atexit.register(gc.unfreeze)
    try:
        yield
    finally:
        gc.callbacks.remove(_freeze_survivors)
