"""`torchrun --nproc-per-node N -m engine.worker CONFIG.toml [--set k=v ...]`: one worker started by any
elastic agent (docs/cluster.md). The step loop itself is engine/run/worker.py."""

from __future__ import annotations

import argparse
import os
import time

from engine.config import load_config
from engine.processes import lifeline
from engine.run.rank import Job
from engine.run.worker_entry import worker_main


def main(argv: list[str] | None = None) -> None:
    """A worker started by any elastic agent: the config and its overrides from the command line."""
    parser = argparse.ArgumentParser(prog="python -m engine.worker")
    parser.add_argument("config")
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    lifeline.hold(lifeline.identity(os.getppid()), cfg.parallel.shutdown_timeout_s,   # the agent that started it
                  stop=int(os.environ.get("GROUP_WORLD_SIZE", "1")) == 1)
    worker_main(Job(config=cfg, launched_at=time.time()))


if __name__ == "__main__":
    main()
