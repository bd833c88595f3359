"""Ready-made runs: `trainyard demo [NAME]` starts one and opens the console on it.

    trainyard demo              # the tour: pipeline + memory policy + hybrid updates at once
    trainyard demo pipeline     # or memory, sharded, hybrid, ps, ddp, llm
    trainyard demo ps --headless

Each demo is a config in demo/configs/ (read it: its comment says what to watch) plus what the
demo changes for 2 cores, and for `llm` the files demo/prepare.py writes first (with `trainyard prepare`). `keys` are the keys that show its technique in the console; the tmux
tests (tests/test_demos.py) press them.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path


@dataclass(frozen=True)
class Demo:
    config: str                       # a file in demo/configs/
    about: str                        # what it shows, one line
    keys: str                         # what to press in the console, one line
    overrides: tuple[str, ...] = ()   # `--set` overrides the demo applies (to fit 2 cores)

    @property
    def path(self) -> Path:
        return Path(str(resources.files(__name__) / "configs" / self.config))


DEMOS: dict[str, Demo] = {
    "tour": Demo("tour.toml", "a transformer on a 2-stage pipeline, skewed at the start, with planned activation "
                              "memory and hybrid optimizer updates",
                 "r rebalance the stages (by itself at step 100; a layer turns slow at step 400) · k/s/c a layer's "
                 "activations · u a layer's update device/host"),
    "pipeline": Demo("digits_pipeline.toml", "digits on a 3-stage pipeline that starts badly split",
                     "r rebalance now (by itself every 150 steps; fc3 turns slow at step 400)"),
    "memory": Demo("text_memory.toml", "a transformer at half the memory keeping its activations needs, "
                                       "each layer's activations planned",
                   "k/s/c keep, swap or recompute the selected layer's activations"),
    "sharded": Demo("text_sharded.toml", "a transformer sharded over 2 workers: updates broadcast in slices over "
                                         "4 streams, each layer's forward gated on its own slices",
                    "watch Streams (bytes, busy %) and the gate times in Devices",
                    overrides=("parallel.world_size=2",)),
    "hybrid": Demo("text_hybrid.toml", "a transformer whose AdamW updates are planned between device and host",
                   "u move the selected layer's update between device and host"),
    "ps": Demo("digits_ps.toml", "digits on 2 parameter servers and 4 workers, one 3x slower, soft sync per layer",
               "m choose the sync mode: soft, bsp, asp, ssp"),
    "ddp": Demo("digits_ddp.toml", "digits on 2 workers with torch DDP, the baseline", "p pause · x checkpoint"),
    "llm": Demo("llm.toml", "a Llama-shaped model from transformers, on a token file read from disk, on a 2-stage "
                            "pipeline (needs transformers and datasets: pip install -e '.[hf,data]')",
                "r rebalance the stages (by itself at step 100) · k/s/c a layer's activations · u its update"),
}
DEFAULT = "tour"



def run_name(demo: str, runs_dir: Path) -> str:
    """`demo-NAME`, whose previous run the demo overwrites, unless that run is still going (left training
    by a console that detached, or starting in another terminal): then `demo-NAME-2`, `-3`, ... the first
    name no live run has."""
    from engine.run.claim import live as holds
    from engine.telemetry.protocol import list_runs
    live = {info.get("run") for info in list_runs()}

    def busy(name: str) -> bool:   # a live run's launcher or workers hold its folder (engine/run/claim.py)
        return name in live or holds(runs_dir / name)

    name, n = f"demo-{demo}", 1
    while busy(name):
        n += 1
        name = f"demo-{demo}-{n}"
    return name
