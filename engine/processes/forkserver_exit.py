"""Imported first in the fork server (engine/processes/forkserver.py): when the server exits, its folder in the
runtime directory goes with it once the launcher that made it is gone. The launcher removes the folder at its
own exit; a launcher killed by SIGKILL cannot, and the server, which exits once the launcher and every worker
are gone (its liveness pipe reads EOF), removes it instead, so a killed run leaves no temp folder behind.
Imports nothing of the engine's but the runtime directory's lookup."""

import atexit
import os
import shutil

from engine.processes.ending import without_final_collection
from engine.processes.lifeline import alive, identity

_server = os.getpid()
_launcher = identity(os.getppid())


def _remove_folder() -> None:
    if os.getpid() != _server:   # a forked worker inherits this handler: not its to run
        return
    without_final_collection()   # the server's exit skips the last walk of torch's objects (ending.py)
    if alive(_launcher):
        return
    from engine.processes.forkserver import PREFIX
    from engine.telemetry.protocol import runtime_path
    try:   # runtime_path: a runtime folder its owner already removed (a test's) is not made again
        shutil.rmtree(runtime_path() / f"{PREFIX}{_launcher[0]}", ignore_errors=True)
    except OSError:
        pass


atexit.register(_remove_folder)
