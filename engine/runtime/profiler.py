"""Per-layer forward and backward times and saved-activation bytes, measured on chosen steps.

    profiler = LayerProfiler(model, ledger, Clock(device))   # model: a LayerList
    profiler.arm()                                 # the next forward+backward is measured
    ... forward, backward ...
    profiler.finish()                              # -> [{"name", "fwd_ms", "bwd_ms", "activation_bytes"}, ...]

Forward: hooks before and after each layer. Backward: a hook on each layer's output
fires when that output's gradient is ready, which is when the layer's backward
starts and the next layer's (in backward order) ends; on the CPU autograd runs on
the calling thread, so these are the layers' own times. The times are marks of the
device's clock (engine/training/timing.py: CUDA events on a GPU, where a layer's kernels run
after its hook has returned), read in `finish`. Unarmed, the hooks return at once.
"""

from __future__ import annotations

import torch

from engine.runtime.devices import MemoryLedger
from engine.training.timing import Clock


def _first_tensor(value):
    if torch.is_tensor(value):
        return value
    if isinstance(value, (tuple, list)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


class LayerProfiler:
    def __init__(self, model, ledger: MemoryLedger, clock: Clock | None = None):
        self.names = list(model.names)
        self.ledger = ledger
        self.clock = clock or Clock()
        self.armed = False
        self._handles = []
        for i, layer in enumerate(model.layers):
            self._handles.append(layer.register_forward_pre_hook(self._before(i)))
            self._handles.append(layer.register_forward_hook(self._after(i)))
        self._reset()

    def _reset(self) -> None:
        n = len(self.names)
        self.fwd_start = [None] * n
        self.fwd_marks = []   # (layer, before, after) of each forward
        self.bwd_start = [None] * n

    def arm(self) -> None:
        self._reset()
        self.ledger.activations_by_layer = {}
        self.ledger.exact_due = True   # per-layer bytes: the ledger counts every saved tensor this step
        self.armed = True

    def _before(self, i: int):
        def hook(module, args):
            if self.armed:
                self.ledger.current_layer = self.names[i]
                self.fwd_start[i] = self.clock.mark()
        return hook

    def _after(self, i: int):
        def hook(module, args, output):
            if not self.armed:
                return
            self.fwd_marks.append((i, self.fwd_start[i], self.clock.mark()))
            self.ledger.current_layer = None
            out = _first_tensor(output)
            if out is not None and out.requires_grad:
                out.register_hook(self._grad_ready(i))
        return hook

    def _grad_ready(self, i: int):
        def hook(grad):
            self.bwd_start[i] = self.clock.mark()
        return hook

    def finish(self) -> list[dict]:
        """Call after backward returned: the measured step, one dict per layer."""
        end = self.clock.mark()
        self.armed = False
        self.clock.settle()
        fwd_ms = [0.0] * len(self.names)
        for i, a, b in self.fwd_marks:
            fwd_ms[i] += self.clock.ms(a, b)
        rows = []
        for i, name in enumerate(self.names):
            start = self.bwd_start[i]
            # layer i's backward ends where the layer before it starts its own
            stop = next((self.bwd_start[j] for j in range(i - 1, -1, -1) if self.bwd_start[j] is not None), end)
            rows.append({"name": name, "fwd_ms": round(fwd_ms[i], 4),
                         "bwd_ms": round(self.clock.ms(start, stop), 4) if start is not None else 0.0,
                         "activation_bytes": int(self.ledger.activations_by_layer.get(name, 0))})
        return rows

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
