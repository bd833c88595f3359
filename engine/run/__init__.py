"""The run: what starts a training job and drives its steps, on top of every strategy.

- launch.py: the launcher (torch's elastic agent: restarts, rendezvous, several hosts) and the run's end (exit
  status, refusals); checks.py: what it refuses before any worker starts; claim.py: the run folder's locks,
  one live run to a folder; agent.py: torch's agent, whose wait at the end skips a host lost for good.
- worker.py: the data-parallel and pipeline step loop (Worker);
  worker_entry.py: what the agent starts in each worker process (worker_main, watching the launcher).
- rank.py: what every rank sets up alike (Job, host placement, pid file, device, data, model).
- handover.py: a user's model and data handed to the workers as copies of their own (never the caller's
  memory), and the run's final weights loaded back into the caller's model.
- report.py: rank 0's step record; layer_rows.py: the console's layer table, gathered on rank 0 from the
  stages or owners that know each layer.
- export.py: `trainyard export`: a run's model out of its checkpoint, as a Hugging Face save_pretrained folder
  (or a LayerList's state dict), and the folder a Hugging Face model's run writes at its end.
  export_tokenizer.py: the tokenizer it copies (the token files' meta.json names it, else the model folder's).
- preload.py: what the launcher's fork server imports (engine/processes/forkserver.py), so workers fork with it.

Imports: everything below it (engine.strategies, engine.techniques, engine.runtime, engine.processes,
engine.telemetry, engine.models, engine.training.data, engine.config). Nothing below imports it.
"""

from engine.processes import forkserver as _forkserver

PRELOAD = "engine.run.preload"   # the module the launcher's fork server imports (engine/run/preload.py)
if PRELOAD not in _forkserver.PRELOADS:   # any fork server of this process (a pool's too) forks with the engine
    _forkserver.PRELOADS.append(PRELOAD)
