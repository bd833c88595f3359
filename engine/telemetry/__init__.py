"""Telemetry: what the run tells the log, the progress bar and the consoles, and the commands it hears.

- protocol.py: the wire protocol (newline-delimited JSON, versioned), the one module a console
  imports (also as engine.protocol); figures.py: every per-rank figure, declared once (the exchange's
  columns, the rank entries, their schema); records.py: a step record's compact forms and the log's parts
  (what a reader undoes; re-exported by protocol.py); schema.py: the JSON schema of every record.
- hub.py + client.py + endpoint.py: rank 0's hub thread serving consoles on a local socket (best effort, never
  slowing training); outlets.py: rank 0's outlets (log, hub, progress bar); log.py: the JSON-lines
  log (complete); headless.py: the progress bar and summary of `run --headless`.
- trackers/: TensorBoard and W&B, fed from the log by the launcher, off every rank's step.

Imports: engine.config, and each other; protocol.py imports nothing from engine but figures.py and
records.py, which import nothing. Nothing here imports the runtime, a strategy or a technique.
"""
