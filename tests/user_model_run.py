"""Train a model of tests/user_models.py through `engine.train`, as a user's script does, and save what the
parity tests compare (tests/test_user_models.py runs it in a process session of its own):

    python tests/user_model_run.py OUT.pt '{"model": "gpt2", "runs": [{"label": "ddp", "world": 2, "config": {...}}]}'

A run may name a model of its own ("model": "mixtral"); the spec's is the default. A run that raises is
recorded by its error alone.

OUT.pt holds one entry per run, each on a fresh model: the caller's model before and after the run (as the
LayerList engine.train makes of it), the final checkpoint's weights, every step's loss, the kinds of the run's
events, and whether a tied weight is still one tensor in the caller's model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import engine
from engine.runtime.checkpoint import list_checkpoints, model_state
from tests.user_models import MODELS, as_layers, masked_token_data, token_data


def state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def main(out: str, spec: dict) -> None:
    results = []
    for run in spec["runs"]:
        config = run["config"]
        config.setdefault("parallel", {})["world_size"] = run["world"]
        config["run"]["name"] = f"{config['run']['name']}-w{run['world']}"
        model = MODELS[run.get("model", spec["model"])](seed=0)
        before = state(as_layers(model))
        log = Path(config["run"]["dir"]) / f"{config['run']['name']}.jsonl"
        data = masked_token_data() if spec.get("data") == "masked" else token_data()
        try:
            summary = engine.train(config, model=model, data=data, telemetry_log=log)
        except Exception as e:   # a refused run: what it said
            results.append({"label": run["label"], "world": run["world"], "model": run.get("model", spec["model"]),
                            "error": f"{type(e).__name__}: {e}"})
            continue
        records = [json.loads(line) for line in log.read_text().splitlines()]
        run_dir = Path(config["run"]["dir"]) / config["run"]["name"]
        layers = as_layers(model)
        results.append({"label": run["label"], "world": run["world"], "model": run.get("model", spec["model"]),
                        "before": before, "caller": state(layers),
                        "checkpoint": model_state(list_checkpoints(run_dir)[-1]),
                        "losses": [r["loss"] for r in records if r["type"] == "step"],
                        "events": [r["kind"] for r in records if r["type"] == "event"],
                        "tied": all(len({id(layers.layer(n).get_parameter(p)) for n, p in tie}) == 1
                                    for tie in layers.ties) and bool(layers.ties),
                        "summary": summary, "left_in_run_dir": sorted(p.name for p in run_dir.iterdir())})
    torch.save(results, out)


if __name__ == "__main__":   # workers are spawned: the launch stays under this guard
    torch.set_num_threads(1)
    main(sys.argv[1], json.loads(sys.argv[2]))
