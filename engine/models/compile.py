"""`[model] compile`: each layer's own forward compiled on its own (regional compilation, as torchtitan does),
the techniques acting around it in eager, at the layer boundaries they already use.

    notes = compile_layers(model)           # every rank, right after building its model (engine/run/rank.py)
    with eager_layers([model.layers[3]]):   # these run eager: a pipeline's arrivals in their migration step
        ...
    compile_figures()                       # {"compile_ms": ..., "recompiles": ...}: this process so far

What is compiled is the function `type(layer).forward`, once per function (torch.compile, dynamic=False), called
with the layer as its first argument; a layer may name a part of itself to compile instead (`compile_part`: a
Hugging Face block's own module, engine/models/hf/parts.py) or none (`compile_part = None`, with `eager_why`).
Dynamo keeps its graphs on the function's code and, inlining the module, lifts the layer's parameters as
graph inputs guarded by shape and dtype, not identity: blocks of one class and shape share one graph, and a
layer that arrives by migration costs a guard check. The layer's instance `forward` becomes that call, so

- module hooks (the profiler's marks, sharded's gates, the updates' and the parameter server's hooks,
  emulated slowness) stay eager, in Module.__call__ around it: none is traced, none breaks a graph;
- the memory policy (engine/techniques/memory/policy.py) wraps the instance forward it finds, so keep, swap
  and recompute act around the compiled call. The ledger's saved-tensor hooks are plain functions, which
  dynamo neither traces nor guards on (torch/_dynamo/guards.py AUTOGRAD_SAVED_TENSORS_HOOKS guards only
  hooks that are GraphModules): they run at run time on what the compiled graph's autograd function saves,
  and swap moves that. Recompute's checkpoint calls the compiled function and reruns it in backward;
- without grad (an evaluation) or in eval mode a layer runs eager: grad mode and `training` are guarded, so
  those calls would each compile another graph for a few calls; the step whose FLOPs are counted runs eager
  too (engine/run/worker.py), since under torch's FlopCounterMode dynamo skips the function's code for good.

Compile time is counted apart (torch._dynamo.callback: every compile's start and end, forward and the backward
compiled at its first run), never inside a stage time a planner reads (engine/strategies/pipeline/stage.py
discards a step that compiled; the parameter server's profile skips it). A recompile is a layer's second
compile: a guard of its graph failed (a shape, a dtype under autocast, a flag changed). After each layer's
first compile there should be none, and the tests hold every strategy to that.

A layer whose compile fails runs eager from then on, and every layer of its class with it, said in one line.
Imports torch only, and torch._dynamo only once a layer is compiled (importing it makes inductor's folder in the
temp dir: a run that does not compile leaves none).
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager

import torch
from torch import nn


class _Figures:
    """This process's compiles: seconds, the compiles dynamo started, and recompiles (see the module's doc)."""

    def __init__(self):
        self.seconds = 0.0
        self.dynamo = 0
        self.recompiles = 0
        self.recompiled: list[str] = []
        self._t0 = 0.0
        self.listening = False

    def start(self, args) -> None:
        self._t0 = time.perf_counter()
        if args.callback_trigger.name == "DYNAMO":
            self.dynamo += 1

    def end(self, args) -> None:
        self.seconds += time.perf_counter() - self._t0


FIGURES = _Figures()
_COMPILED: dict = {}      # a forward function -> its torch.compile'd function (one per function, every layer's)
_FAILED: dict = {}        # a forward function whose compile failed -> why
_EAGER: set[int] = set()  # ids of the layers that run eager for now (eager_layers)


def _listen() -> None:
    """Count compile time (torch._dynamo.reset() drops the callbacks: listen again after one)."""
    from torch._dynamo.callback import callback_handler
    if FIGURES.start not in callback_handler.start_callbacks:
        callback_handler.register_start_callback(FIGURES.start)
        callback_handler.register_end_callback(FIGURES.end)
    # inductor puts the C++ headers it precompiles for the CPU in the temp dir whatever TORCHINDUCTOR_CACHE_DIR
    # says (torch/_inductor/codecache.py _HEADER_DIR, read when a header is built): in that cache instead, as
    # engine/processes/children.py keeps the rest of it out of the temp dir
    from torch._inductor import codecache
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    if hasattr(codecache, "_HEADER_DIR") and hasattr(codecache, "_HEADER_LOCK_DIR"):
        codecache._HEADER_DIR = os.path.join(cache_dir(), "precompiled_headers")
        codecache._HEADER_LOCK_DIR = os.path.join(codecache._HEADER_DIR, "locks")


class CompiledForward:
    """A layer's instance `forward`: its own forward's compiled function, called with the layer."""

    def __init__(self, name: str, owner: nn.Module, module: nn.Module):
        self.name, self.owner, self.module = name, owner, module
        self.function = type(module).forward
        self.eager = self.function.__get__(module)
        if self.function not in _COMPILED:
            _COMPILED[self.function] = torch.compile(self.function, dynamic=False)
        self.compiled = _COMPILED[self.function]
        self.compiles = 0   # calls of this layer that compiled a graph: more than one is a recompile

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled() or not self.module.training or id(self.owner) in _EAGER \
                or self.function in _FAILED:
            return self.eager(*args, **kwargs)
        from torch._dynamo.exc import TorchDynamoException   # imported once compiling: it makes inductor's temp folder
        before = FIGURES.dynamo
        try:
            out = self.compiled(self.module, *args, **kwargs)
        except TorchDynamoException as e:   # a compile that failed (eager's own error, if any, is raised)
            out = self.eager(*args, **kwargs)
            first = (str(e).strip().splitlines() or [""])[0]
            _FAILED[self.function] = f"{type(e).__name__}: {first[:200]}"
            print(f"trainyard: model.compile: {type(self.module).__name__} ({self.name}) runs eager: its compile "
                  f"failed ({_FAILED[self.function]})", file=sys.stderr, flush=True)
            return out
        if FIGURES.dynamo != before:
            self.compiles += 1
            if self.compiles > 1:
                FIGURES.recompiles += 1
                FIGURES.recompiled.append(self.name)
                print(f"trainyard: model.compile: {self.name} ({type(self.module).__name__}) compiled again: a guard "
                      f"of its graph failed (TORCH_LOGS=recompiles says which)", file=sys.stderr, flush=True)
        return out


def compile_layers(model) -> list[str]:
    """Compile each layer of `model` (a LayerList) on its own, lazily (the graphs at their first calls).
    Returns a line for each layer left eager, saying why."""
    _listen()
    notes = []
    for name, layer in zip(model.names, model.layers):
        part = getattr(layer, "compile_part", "")
        if part is None:
            notes.append(f"{name} ({type(layer).__name__}) runs eager: {getattr(layer, 'eager_why', 'it says so')}")
            continue
        module = layer.get_submodule(part) if part else layer
        if "forward" in module.__dict__:   # a forward of its own (set on the instance): not the class's to compile
            notes.append(f"{name} ({type(layer).__name__}) runs eager: its forward is an instance attribute")
            continue
        module.forward = CompiledForward(name, layer, module)
    return notes


def uncompile(model) -> None:
    """The layers' own forwards back (tests)."""
    for layer in model.layers:
        for module in layer.modules():
            if isinstance(module.__dict__.get("forward"), CompiledForward):
                del module.__dict__["forward"]


@contextmanager
def eager_layers(layers):
    """The `layers` run eager inside (their compiled graphs are not asked for)."""
    ids = {id(layer) for layer in layers} - _EAGER
    _EAGER.update(ids)
    try:
        yield
    finally:
        _EAGER.difference_update(ids)


def compile_figures() -> dict:
    """This process's compile milliseconds and recompiles so far (the step's exchange carries them)."""
    return {"compile_ms": FIGURES.seconds * 1000, "recompiles": FIGURES.recompiles}
