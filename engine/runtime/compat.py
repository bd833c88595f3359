"""What differs between the torch releases trainyard runs on, detected at run time instead of required.

The floor is torch 2.8 (pyproject.toml), set by torch fixes that no option brings back:
- torch.distributed.pipelining waits for every send of a batch_isend_irecv only from 2.8: before, on
  gloo, Schedule1F1B drops sends it has not waited for and its peer times out, so the torch baseline
  of `trainyard bench pipeline` (engine/bench/torch_pipeline.py) cannot run (its GPipe can);
- before 2.7 a gloo process group is freed holding the GIL (2.7 frees the gloo backend without it,
  2.8 the process group too), so a worker whose last collective is still being cleaned up on gloo's
  thread can deadlock at exit: on 2.4, `trainyard run demo/configs/digits_pipeline.toml` hung after
  its summary in 3 of 9 runs (0 of 8 on 2.7 and on 2.8).
Everything else trainyard uses is older: `LaunchConfig.logs_specs` (2.3: the agent's logs in the run
directory; a LaunchConfig without it is said once, as below), the c10d rendezvous's keep_alive_*
options (2.7), the pipelining schedules' `scale_grads` (2.7) and shape inference (2.6),
TORCH_DISABLE_SHARE_RDZV_TCP_STORE (2.5; before it the store was never shared),
`torch.distributed.pipelining` itself (2.4), `register_post_accumulate_grad_hook` (2.1), non-reentrant
checkpoint with `context_fn`, DDP comm hooks, `saved_tensors_hooks`, `torch.frombuffer`,
`dist.get_global_rank` / `get_group_rank`.

Newer than the floor, and what happens without it:
- `LaunchConfig.shutdown_timeout` (torch 2.12): before it the agent, on SIGINT/SIGTERM, signals the
  workers and waits a fixed 30 s before it kills them, so `parallel.shutdown_timeout_s` is not applied.
  `launch_config` leaves out every field this torch's LaunchConfig lacks and says so once on stderr.
- the pipelining schedules' `step(return_outputs=...)` (torch 2.10): before it an unknown keyword goes
  to the stage's forward, so engine/bench/torch_pipeline.py passes it only where `accepts` says so.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys

import torch
from torch.distributed.launcher.api import LaunchConfig

FLOOR = (2, 8)

# what torch does where LaunchConfig has no shutdown_timeout (torch 2.8 .. 2.11): the agent's _shutdown
# calls PContext.close(death_sig), whose timeout defaults to 30 s, then sends SIGKILL
OLD_SHUTDOWN_WAIT_S = 30

_said: set[str] = set()


def say_once(key: str, message: str) -> None:
    """Print `message` on stderr ("trainyard: ..."), once per process for each `key`."""
    if key in _said:
        return
    _said.add(key)
    print(f"trainyard: {message}", file=sys.stderr, flush=True)


def below_floor(version: str | None = None) -> str | None:
    """A line saying what breaks when this torch (or `version`) is older than FLOOR; None when it is not.
    pip enforces the floor, but a GPU image's torch may have been kept with --no-deps."""
    version = version or torch.__version__
    parts = version.split("+")[0].split(".")
    if (int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)) >= FLOOR:
        return None
    return (f"torch {version} is older than trainyard's floor {FLOOR[0]}.{FLOOR[1]}: workers may hang at exit "
            f"on gloo and the torch 1F1B baseline of `trainyard bench pipeline` cannot run (engine/runtime/compat.py)")


def accepts(fn, name: str) -> bool:
    """Whether callable `fn` (a class: its constructor) takes a parameter called `name`."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def launch_config_fields(cls=None) -> set[str]:
    """The fields this torch's LaunchConfig (or `cls`) accepts."""
    cls = cls or LaunchConfig
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls) if f.init}
    return set(inspect.signature(cls).parameters)


def _dropped_message(name: str, value) -> str:
    where = f"torch {torch.__version__}'s launcher has no {name}"
    if name == "shutdown_timeout":
        return (f"{where}; parallel.shutdown_timeout_s = {value:g} is not applied (on Ctrl-C or SIGTERM torch "
                f"signals the workers and waits its fixed {OLD_SHUTDOWN_WAIT_S} s before it kills them)")
    if name == "logs_specs":
        return (f"{where}; the elastic agent's logs go to a torchelastic_* folder in the system temp dir, not to "
                f"{value.root_log_dir}")
    return f"{where}; {name} = {value!r} is not applied"


def launch_config(**fields) -> LaunchConfig:
    """torch's LaunchConfig(**fields), without the fields this torch's LaunchConfig lacks; each one left
    out is said once on stderr, with what torch does instead."""
    accepted = launch_config_fields()
    for name, value in fields.items():
        if name not in accepted:
            say_once(f"launch:{name}", _dropped_message(name, value))
    return LaunchConfig(**{k: v for k, v in fields.items() if k in accepted})
