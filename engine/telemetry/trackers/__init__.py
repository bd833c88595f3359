"""Trackers beside the console: TensorBoard and Weights & Biases record what the telemetry log holds.

- follow.py: the launcher follows the log as rank 0 writes it (follow_trackers, around the workers);
- feed.py: a bounded queue (drops and counts what does not fit) and the thread that calls the trackers,
  saying once a tracker that fails;
- tensorboard_run.py (`<run dir>/tb/`), wandb_run.py (`<run dir>/wandb/`): the trackers themselves, which
  import tensorboard's writer (through torch) and wandb when they start.

Imports engine.telemetry.records and each other; the config is handed in. docs/telemetry.md, Trackers.
"""
