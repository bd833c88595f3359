"""Emulated trouble for demos and tests: a layer that turns slow mid-run (`[emulate]`).

    slow = SlowLayer.install(model, cfg.emulate)   # None when no layer is named
    slow.step = step                                # the worker's step loop, before each step

The layer's forward sleeps `slow_layer_ms` from step `slow_from_step` on. Every rank builds the
whole model and the hook sits on the layer's module, so it stays slow wherever the layer runs,
after a pipeline migration too; the pipeline's layer clock counts the sleep as the layer's time.
"""

from __future__ import annotations

import time


class SlowLayer:
    def __init__(self, module, sleep_ms: float, from_step: int):
        self.sleep_s, self.from_step = sleep_ms / 1000, from_step
        self.step = 0
        module.register_forward_hook(self._after_forward)

    @classmethod
    def install(cls, model, emulate) -> "SlowLayer | None":
        if not emulate.slow_layer:
            return None
        if emulate.slow_layer not in model.names:
            raise ValueError(f"emulate.slow_layer = {emulate.slow_layer!r} is not a layer of this model; its layers "
                             f"are: {', '.join(model.names)}")
        module = model.layers[model.names.index(emulate.slow_layer)]
        return cls(module, emulate.slow_layer_ms, emulate.slow_from_step)

    def _after_forward(self, module, args, output):
        if self.step >= self.from_step:
            time.sleep(self.sleep_s)
