"""Train a model of tests/user_models.py through `engine.train`, as a user's script does, and save what the
parity tests compare (tests/test_user_models.py runs it in a process session of its own):

    python tests/user_model_run.py OUT.pt '{"model": "encoder", "worlds": [1, 2], "config": {...}}'

OUT.pt holds one entry per world size: the caller's model before and after the run, the final
checkpoint's weights, every step's loss, and the kinds of the run's events.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import engine
from engine.runtime.checkpoint import list_checkpoints, model_state
from tests.user_models import MODELS, token_data


def state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def main(out: str, spec: dict) -> None:
    results = []
    for world in spec["worlds"]:
        config = json.loads(json.dumps(spec["config"]))
        config.setdefault("parallel", {})["world_size"] = world
        config["run"]["name"] = f"{config['run']['name']}-w{world}"
        model = MODELS[spec["model"]](seed=0)
        before = state(model)
        log = Path(config["run"]["dir"]) / f"{config['run']['name']}.jsonl"
        summary = engine.train(config, model=model, data=token_data(), telemetry_log=log)
        records = [json.loads(line) for line in log.read_text().splitlines()]
        run_dir = Path(config["run"]["dir"]) / config["run"]["name"]
        results.append({"world": world, "before": before, "caller": state(model),
                        "checkpoint": model_state(list_checkpoints(run_dir)[-1]),
                        "losses": [r["loss"] for r in records if r["type"] == "step"],
                        "events": [r["kind"] for r in records if r["type"] == "event"],
                        "summary": summary, "left_in_run_dir": sorted(p.name for p in run_dir.iterdir())})
    torch.save(results, out)


if __name__ == "__main__":   # workers are spawned: the launch stays under this guard
    torch.set_num_threads(1)
    main(sys.argv[1], json.loads(sys.argv[2]))
