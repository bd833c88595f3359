"""The learning rate and the gradient norm from step records to the console's curves, and the schema of the
step fields and events that carry them (lr, grad_norm, clipped, skipped, redone_layers; step_skipped and
step_rolled_back). Records from before them still validate and still draw.

Run: `python -m pytest tests/test_training_curves.py -q`.
"""

from __future__ import annotations

import asyncio
from math import isnan

import jsonschema
import pytest
from textual.app import App, ComposeResult

from console.state import RunState
from engine.telemetry.schema import RECORD_SCHEMA
from widgets.curves import KEEP, Curves

HELLO = {"type": "hello", "run": "clip", "mode": "ddp", "world_size": 2}
RANK = {"rank": 0, "loss": 1.0, "step_ms": 5.0, "fwd_ms": 1.0, "bwd_ms": 2.0, "optim_ms": 1.0, "wait_ms": 0.0,
        "parameters_bytes": 64, "gradients_bytes": 64, "optimizer_state_bytes": 128, "activations_bytes": 0,
        "swapped_bytes": 0, "used_bytes": 256, "peak_bytes": 512, "capacity_bytes": 4096, "over_capacity": False,
        "rss_bytes": 1 << 20, "cpu_percent": 50.0}


def step(n: int, **fields) -> dict:
    return {"schema": 1, "time": 100.0 + n, "type": "step", "step": n, "loss": 2.0 / n, "samples_per_s": 1000.0,
            "step_ms": 5.0, "ranks": [RANK], **fields}


def points_of(*records: dict) -> list[tuple]:
    """What the console's state hands the curves for these step records."""
    state = RunState()
    state.apply(HELLO)
    for record in records:
        state.apply(record)
    return state.take()[0]


def drawn(points: list[tuple], test, size=(120, 40)) -> None:
    """Feed `points` to a Curves as the app does (`add_point(*point)`), redraw, and run `test(curves)`."""
    class Host(App):
        def compose(self) -> ComposeResult:
            yield Curves()

    async def run() -> None:
        async with Host().run_test(size=size) as pilot:
            await pilot.pause()
            curves = pilot.app.query_one(Curves)
            for point in points:
                curves.add_point(*point)
            curves.last_redraw = float("-inf")   # now, not after the throttle
            curves.redraw()
            await pilot.pause()
            test(curves)

    asyncio.run(run())


NEW = [step(1, lr=1e-4, grad_norm=0.5, clipped=False, skipped=False, redone_layers=0),
       step(2, lr=2e-4, grad_norm=3.2, clipped=True, skipped=False, redone_layers=14),
       step(3, lr=3e-4, grad_norm=None, clipped=False, skipped=True, redone_layers=14),
       step(4, lr=3e-4, grad_norm=0.75, clipped=False, skipped=False, redone_layers=0)]


@pytest.mark.timeout(60)
def test_step_records_give_the_curves_their_lr_and_grad_norm():
    points = points_of(*NEW)
    assert [p[3] for p in points] == [1e-4, 2e-4, 3e-4, 3e-4]
    assert [p[4] for p in points] == [0.5, 3.2, None, 0.75]

    def test(curves: Curves) -> None:
        assert list(curves.steps) == [1, 2, 3, 4]
        assert list(curves.lrs) == [1e-4, 2e-4, 3e-4, 3e-4]
        norms = list(curves.grad_norms)
        assert norms[:2] == [0.5, 3.2] and isnan(norms[2]) and norms[3] == 0.75   # the skipped step: no point
        assert list(curves.clipped) == [False, True, False, False]
        assert list(curves.skipped) == [False, False, True, False]
        # the plots as before, the two new curves on their lines under them
        assert curves.loss_plot.display and not curves.has_class("-compact")
        assert curves.lr_line.display and curves.norm_line.display
        assert curves.lr_line.spark.data == [1e-4, 2e-4, 3e-4, 3e-4]
        assert curves.norm_line.spark.data == [0.5, 3.2, 0.75]
        assert str(curves.lr_line.label.content) == "lr 0.0003"
        assert str(curves.norm_line.label.content) == "grad norm 0.75"
        assert str(curves.norm_line.note.content).strip() == "1 clipped, 1 skipped"

    drawn(points, test)


@pytest.mark.timeout(60)
def test_records_without_lr_or_grad_norm_are_accepted_and_draw_the_loss_alone():
    old = [step(n) for n in range(1, 6)]   # a log from before steps carried them
    for record in old:
        jsonschema.validate(record, RECORD_SCHEMA)
    points = points_of(*old)
    assert all(p[3:] == (None, None, False, False) for p in points)

    def test(curves: Curves) -> None:
        assert list(curves.losses) == [2.0 / n for n in range(1, 6)]
        assert all(isnan(v) for v in [*curves.lrs, *curves.grad_norms])
        assert curves.loss_plot.display and curves.rate_plot.display
        assert not curves.lr_line.display and not curves.norm_line.display

    drawn(points, test)


@pytest.mark.timeout(60)
def test_a_run_that_neither_clips_nor_skips_draws_the_lr_without_a_grad_norm():
    points = points_of(*(step(n, lr=0.1 * n, grad_norm=None, clipped=False, skipped=False, redone_layers=0)
                         for n in range(1, 4)))

    def test(curves: Curves) -> None:
        assert curves.lr_line.display and not curves.norm_line.display
        assert curves.lr_line.spark.data == pytest.approx([0.1, 0.2, 0.3])

    drawn(points, test)


@pytest.mark.timeout(60)
def test_a_short_panel_draws_every_curve_on_a_line():
    # 10 rows: one plot row (8) and the two lines fit in 10, not in 9
    def fits(curves: Curves) -> None:
        assert not curves.has_class("-compact") and curves.loss_plot.display

    def short(curves: Curves) -> None:
        assert curves.has_class("-compact") and not curves.loss_plot.display
        assert all(line.display for line in (curves.loss_line, curves.rate_line, curves.lr_line, curves.norm_line))
        assert str(curves.loss_line.label.content) == "loss 0.5"

    drawn(points_of(*NEW), fits, size=(100, 10))
    drawn(points_of(*NEW), short, size=(100, 9))


@pytest.mark.timeout(120)
def test_a_long_run_keeps_the_last_steps_and_a_restart_drops_the_old_future():
    points = [(n, 1.0, 1000.0, 1e-3 * (1 - n / 100_000), 1.0 + n % 7, n % 10 == 0, n % 1000 == 0)
              for n in range(1, 100_001)]
    points += [(99_990, 1.0, 1000.0, 5e-4, 2.0, False, False)]   # a restart replays from step 99,990

    def test(curves: Curves) -> None:
        assert len(curves.steps) == len(curves.lrs) == len(curves.clipped) == KEEP - 10
        assert curves.steps[-1] == 99_990 and curves.lrs[-1] == 5e-4 and curves.grad_norms[-1] == 2.0
        # among steps 99,501..99,989 kept, every tenth was clipped and none of 99,990's replaced future counts
        assert curves.norm_note() == f"{sum(1 for n in range(99_501, 99_990) if n % 10 == 0)} clipped"
        assert len(curves.lr_line.spark.data) == KEEP - 10

    drawn(points, test)


def test_the_schema_takes_the_new_step_fields_and_events():
    validator = jsonschema.Draft202012Validator(RECORD_SCHEMA)
    for record in NEW:
        validator.validate(record)
    event = {"schema": 1, "time": 1.0, "type": "event"}
    validator.validate({**event, "kind": "step_skipped", "step": 120, "grad_norm": None, "redone_layers": 14})
    validator.validate({**event, "kind": "step_rolled_back", "step": 87, "grad_norm": 3.2, "clip": 1.0,
                        "redone_layers": 14})
    for bad in (step(1, lr=-1.0), step(1, redone_layers=1.5), step(1, clipped="yes"),
                {**event, "kind": "step_rolled_back", "step": 87, "grad_norm": 3.2, "redone_layers": 14},
                {**event, "kind": "step_skipped", "step": 120, "grad_norm": None}):
        with pytest.raises(jsonschema.ValidationError):
            validator.validate(bad)
