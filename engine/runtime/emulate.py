"""Emulated trouble for demos and tests (`[emulate]`): a layer that turns slow mid-run, a slow rank.

    slow = SlowLayer.install(model, cfg.emulate)   # None when no layer is named
    slow.step = step                                # the worker's step loop, before each step
    straggler = SlowRank.install(model, cfg.emulate, rank)   # None unless this rank is `slow_rank`
    straggler.step = step

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


class SlowRank:
    """`emulate.slow_rank`: that rank's first layer sleeps `slow_rank_ms` in its forward once a step, so its
    compute takes longer than its peers' and they wait for it at the boundary: a straggler. The sleep is on
    the host; on a GPU the device's clock sees it as idle time before the first layer's kernels."""

    def __init__(self, module, sleep_ms: float, from_step: int):
        self.sleep_s, self.from_step = sleep_ms / 1000, from_step
        self.step = 0
        self.slept_step = -1
        module.register_forward_pre_hook(self._before_forward)

    @classmethod
    def install(cls, model, emulate, rank: int) -> "SlowRank | None":
        if emulate.slow_rank != rank or emulate.slow_rank_ms <= 0:
            return None
        return cls(model.layers[0], emulate.slow_rank_ms, emulate.slow_from_step)

    def _before_forward(self, module, args):
        if self.step >= self.from_step and self.slept_step != self.step:   # once a step, not per micro-batch
            self.slept_step = self.step
            time.sleep(self.sleep_s)
