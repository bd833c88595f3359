"""Per-layer forward and backward times and saved-activation bytes, measured on chosen steps.

    profiler = LayerProfiler(model, ledger, Clock(device))   # model: a LayerList
    profiler.arm()                                 # the next forward+backward is measured
    ... forward, backward ...
    profiler.finish()                              # -> [{"name", "fwd_ms", "bwd_ms", "activation_bytes"}, ...]

Forward: hooks before and after each layer. Backward: a hook on each layer's output
fires when that output's gradient is ready, which is when the layer's backward
starts and the next layer's (in backward order) ends; on the CPU autograd runs on
the calling thread, so these are the layers' own times. The marks are the one per-layer
timer's (engine/training/timing.py LayerSpans, on the device's clock: CUDA events on a GPU, where
a layer's kernels run after its hook has returned), read in `finish`.

The hooks are on the layers only from `arm` to `finish` (or `disarm`): a module with no hook takes torch's
fast call path, which the steps between measured ones keep (40 us of a 3.8 ms forward at `trainyard bench
step`'s host size). Put on last, they run after the gates a strategy or a host update puts before a layer's
forward, so a layer's time is its own, without the wait for its weights (as sharded's always was).
"""

from __future__ import annotations

from engine.runtime.devices import MemoryLedger
from engine.training.timing import Clock, LayerSpans, first_tensor


class LayerProfiler:
    def __init__(self, model, ledger: MemoryLedger, clock: Clock | None = None):
        self.names = list(model.names)
        self.ledger = ledger
        self.spans = LayerSpans(clock)
        self.clock = self.spans.clock
        self.armed = False
        self._layers = list(model.layers)
        self._handles = []
        self._started: dict[int, object] = {}

    def arm(self) -> None:
        self.spans.clear()
        self.ledger.activations_by_layer = {}
        self.ledger.layers_due = True   # per-layer bytes: counted by tensor, or as the unit's first such step was
        self.armed = True
        if not self._handles:
            for i, layer in enumerate(self._layers):
                self._handles.append(layer.register_forward_pre_hook(self._before(i)))
                self._handles.append(layer.register_forward_hook(self._after(i)))

    def disarm(self) -> None:
        """Nothing measured until the next `arm`: the hooks off the layers."""
        self.armed = False
        self.remove()

    def _before(self, i: int):
        def hook(module, args):
            if self.armed:
                self.ledger.current_layer = self.names[i]
                self._started[i] = self.clock.mark()
        return hook

    def _after(self, i: int):
        def hook(module, args, output):
            if not self.armed:
                return
            t0 = self._started.pop(i, None)
            self.ledger.current_layer = None
            if t0 is None:   # armed while this layer ran: its next forward counts
                return
            self.spans.forward(i, t0)
            out = first_tensor(output)
            if out is not None and out.requires_grad:   # its gradient starts this layer's backward
                self.spans.backward_from(i, out)
        return hook

    def finish(self) -> list[dict]:
        """Call after backward returned: the measured step, one dict per layer."""
        self.spans.end_backward()   # the first layer's backward ends here
        self.disarm()
        fwd_ms, bwd_ms, _, _ = self.spans.read()
        return [{"name": name, "fwd_ms": round(fwd_ms.get(i, 0.0), 4), "bwd_ms": round(bwd_ms.get(i, 0.0), 4),
                 "activation_bytes": int(self.ledger.activations_by_layer.get(name, 0))}
                for i, name in enumerate(self.names)]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
