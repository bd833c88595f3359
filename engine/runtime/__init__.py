"""The runtime: what runs a training job whatever its strategy.

- launch.py: the launcher (torch's elastic agent: restarts, rendezvous, several hosts); refusal.py: a
  worker's refusal ends the run (exit 2) instead of a restart; compat.py: what this torch can do.
- handover.py: a user's model and data handed to the workers as copies of their own (never the caller's
  memory), and the run's final weights loaded back into the caller's model.
- rank.py: what every rank sets up alike (Job, stop flag, pid file, device, data, model, run_start);
  worker.py: the data-parallel and pipeline step loop and its boundary; control.py: the boundary's
  exchange (every rank's figures, the operator's commands); layer_rows.py: the console's layer
  table, gathered on rank 0 from the stages or the owners that know each layer.
- topology.py: the one place that owns ranks and process groups (compute, streams, side group).
- devices.py: CUDA GPU or CPU with the memory ledger; profiler.py: per-layer times; emulate.py: emulated
  trouble (a layer made slow mid-run, a slow rank, a rank killed at a technique's moment).
- checkpoint.py: atomic checkpoints with checksums; procpool.py, cluster.py: process pools for tests
  and benches, and the emulated cluster (network namespaces, shaped links); children.py: a command's
  child runs, each in a process session of its own, stopped with the command (signals included).

Imports: engine.config, engine.data, engine.models, engine.optim, engine.timing, and each other. launch.py and
worker.py sit on top of everything: they also import engine.strategies, engine.techniques and
engine.telemetry; refusal.py knows the refusal errors of engine.techniques.memory. No strategy or
technique imports launch.py or worker.py.
"""
