"""The runtime: the ground every strategy and technique stands on, whatever the strategy.

- topology.py: the one place that owns ranks and process groups (compute, streams, side group).
- devices.py: CUDA GPU or CPU; ledger.py: the memory ledger that counts a device's tensors by category;
  profiler.py: per-layer times; meter.py: the one meter of a communication stream.
- control.py: the step boundary's exchange (every rank's figures, the operator's commands).
- lifecycle.py: the stop flag, run_start, the operator's commands every run takes and the run's end, shared by
  the step loop (engine/run/worker.py) and the parameter server's coordinator.
- events.py: what a technique or strategy says after a step, forwarded unread by the loop to the telemetry.
- checkpoint.py: atomic checkpoints with checksums, read by name at any job shape (checkpoint_files.py: each
  rank's safetensors file and the reader); refusal.py: a worker's refusal ends the run (exit 2)
  instead of a restart; compat.py: what this torch can do; emulate.py: emulated trouble (a layer made slow
  mid-run, a slow rank, a rank killed at a technique's moment).

Imports: engine.config, engine.models, engine.training.data, engine.training.loss, engine.training.optim, engine.training.precision, engine.training.timing,
engine.telemetry, and each other. Nothing above: no technique, strategy, process pool or the run
(tests/test_layout.py).
"""
