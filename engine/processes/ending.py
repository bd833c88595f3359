"""The end of a process that has imported torch, without the interpreter's last garbage collections.

    skip_final_collection_at_exit()   # the CLI's main, first thing: at exit, once the atexit handlers
                                      # registered after it (the command's own) have run, every object is frozen
    without_final_collection()        # the fork server's exit handler, its work done

At exit the interpreter collects garbage once more, walking every object it tracks in search of cycles: with
torch, torch._dynamo and torch.distributed imported, that walk is most of a second or two. On this machine
`python -c "import torch, torch._dynamo, torch.distributed"` took 5.4-7.1 s in six runs, and 3.8-5.5 s with
`gc.freeze()` as its last statement (3.7-5.3 s ending in `os._exit(0)`). Every `trainyard run` pays it in the
launcher and again in the workers' fork server (the workers themselves leave through `os._exit`, as
multiprocessing's fork server ends its children).

`gc.freeze()` moves every tracked object to the permanent generation, which collections skip. Nothing else
changes: atexit handlers still run, the standard streams are still flushed, and objects are still freed by
their reference counts as the interpreter clears its modules. What is given up: an object that only a cycle
keeps alive is not finalized at exit (the system takes its memory back). That is why it happens only at the
exit of the engine's own processes: the CLI's (engine/cli.py; a test that calls `main` in its own process
keeps collecting until it exits) and the fork server's (forkserver_exit.py); never in a user's process that
trains through `engine.train`. Imports nothing of the engine's.
"""

import atexit
import gc


def without_final_collection() -> None:
    gc.freeze()


def skip_final_collection_at_exit() -> None:
    """At this process's exit, once the atexit handlers registered after this call have run, freeze every
    object. Called again, still once."""
    atexit.unregister(without_final_collection)
    atexit.register(without_final_collection)
