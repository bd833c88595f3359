"""The console's main screen, wide and narrow, for a data-parallel and a pipeline run, and wide
for a parameter-server run, a data-parallel run on two GPUs and a pipeline of 16 stages x 4 replicas.

Replayed feeds, preloaded and paused, so every picture is the same: times come from the
records, not the clock. Refresh the SVGs after a deliberate change with
`pytest tests/test_console_snapshots.py --snapshot-update`, and look at them.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from console.app import ConsoleApp
from console.client import ReplaySource
from widgets.curves import Curves
from widgets.devices import DevicesPanel
from widgets.throttle import Throttle
from widgets.layers import LayerTable

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(autouse=True)
def utc(monkeypatch):
    monkeypatch.setenv("TZ", "UTC")   # the events panel prints the records' times
    time.tzset()
    yield
    monkeypatch.delenv("TZ")
    time.tzset()


async def settle(pilot) -> None:
    app = pilot.app
    # repaint at once (the panels' 4-per-second throttle would make the picture racy)
    for widget in app.query("*"):
        for throttle in vars(widget).values():
            if isinstance(throttle, Throttle):
                throttle.interval_s = 0.0
    # every record before the pause applied, counted (the feed's thread posts them, then "ready"; a picture
    # once held a header of the replay half applied, ready or not, cause not found)
    deadline, preload = time.monotonic() + 40, app.source.preload
    while not (app.replay_ready and app.state.messages >= preload) and time.monotonic() < deadline:
        await pilot.pause(0.05)
    assert app.replay_ready and app.state.messages >= preload, (app.state.messages, preload)
    await pilot.pause(0.1)
    app.refresh_panels(force=True)
    app.query_one(Curves).redraw()
    # panels repaint at most 4 times a second: let a held update land, then draw once more
    await pilot.pause(0.4)
    app.refresh_panels(force=True)
    app.query_one(Curves).redraw()
    table = app.query_one(LayerTable)
    table.shown = None      # rebuild: column widths then fit these rows, whatever came before
    table.refill()
    await pilot.pause(0.2)
    # a loaded machine may not have had the idle moment in which the table measures its new columns
    deadline = time.monotonic() + 5
    while (table._require_update_dimensions or table._new_rows) and time.monotonic() < deadline:
        await pilot.pause(0.05)
    await pilot.pause(0.1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size,press", [((120, 40), ()), ((80, 24), ())], ids=["wide", "narrow"])
def test_ddp_main_screen(snap_compare, size, press):
    app = ConsoleApp(ReplaySource(FIXTURES / "ddp_feed.jsonl", paused=True, preload=48))
    assert snap_compare(app, press=press, terminal_size=size, run_before=settle)


def pressing(*keys: str):
    """Settle after pressing `keys` (a page that appears lays its table out anew: a screenshot taken
    right after the key, as snap_compare's `press` takes it, could catch the columns before their rows
    were measured)."""
    async def run_before(pilot) -> None:
        await pilot.press(*keys)
        await settle(pilot)
    return run_before


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size,press", [((120, 40), ()), ((80, 24), ("2",))], ids=["wide", "narrow-layers"])
def test_pipeline_main_screen(snap_compare, size, press):
    app = ConsoleApp(ReplaySource(FIXTURES / "pipeline_feed.jsonl", paused=True, preload=26))
    assert snap_compare(app, terminal_size=size, run_before=pressing(*press))


@pytest.mark.timeout(60)
def test_gpu_main_screen(snap_compare):
    # every record but the summary: the cards show each GPU's name, allocator, NVML and the ledger's gap;
    # the events panel says which device the run chose and why
    app = ConsoleApp(ReplaySource(FIXTURES / "gpu_feed.jsonl", paused=True, preload=33))
    assert snap_compare(app, terminal_size=(120, 40), run_before=settle)


async def settle_at_the_last_workers(pilot) -> None:
    await settle(pilot)
    pilot.app.query_one(DevicesPanel).scroll_end(animate=False, immediate=True)   # the slow worker, now lost
    await pilot.pause(0.1)


@pytest.mark.timeout(60)
def test_param_server_main_screen(snap_compare):
    # every record but the summary: sync back to soft, rank 5 lost at step 26
    source = ReplaySource(FIXTURES / "ps_run.jsonl", paused=True, preload=39)
    assert snap_compare(ConsoleApp(source), terminal_size=(120, 40), run_before=settle_at_the_last_workers)


@pytest.mark.timeout(60)
def test_pipeline_grid_main_screen(snap_compare, tmp_path):
    # 16 stages x 4 replicas on 8 hosts: the Devices table a line per stage and its replicas under it (replica
    # 2 of stage 5 slow, its stage's others waiting on it), the layers' stages held by 4 replicas each
    from tests.fleet_feed import pipeline_grid_feed, write_feed
    messages = pipeline_grid_feed(16, 4, slow=(5, 2))
    source = ReplaySource(write_feed(messages, tmp_path / "grid.jsonl"), paused=True, preload=len(messages) - 1)
    assert snap_compare(ConsoleApp(source), terminal_size=(120, 40), run_before=settle)
