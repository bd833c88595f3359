"""How the engine and its commands run processes, apart from training.

- forkserver.py: the fork server workers start from (torch imported once; the launcher adds the engine; or
  one another process shares: TRAINYARD_FORK_SERVER), and what a forked worker takes from its launcher;
  forkserver_exit.py: its folder removed as it exits, once its launcher is gone.
- lifeline.py: a worker's watch on its launcher (gone: stop, then exit), and the run's mark in the environment.
- procpool.py: pools of ranks for tests and benches (one process group, jobs sent as functions).
- cluster.py: the emulated cluster (network namespaces joined by shaped links) for tests and benches.
- children.py: a command's child runs, each in a process session of its own, stopped with the command.
- ending.py: the end of a process that imported torch, without the interpreter's last garbage collections.

Imports: engine.runtime's ground (topology) and engine.telemetry.protocol (the runtime directory). Nothing of
the strategies or the run.
"""
