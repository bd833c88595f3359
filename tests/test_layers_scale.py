"""The Layers, Stages and Streams panels at LLM size: a 32-block transformer's 195 layers, 8 and 16
pipeline stages, 8 communication streams (synthetic feeds: tests/llm_feed.py).

    python -m pytest tests/test_layers_scale.py -q
    python -m pytest tests/test_layers_scale.py --snapshot-update    # after a deliberate change; look at them

Pure helpers first, then each panel mounted alone, then the console's keys, then snapshots of each
panel styled by console/app.tcss.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from textual.app import App, ComposeResult

from console.app import ConsoleApp
from console.client import ReplaySource
from llm_feed import layer_rows, pipeline_records, stage_rows, stream_entries, transformer_names, write_feed
from widgets.throttle import Throttle
from widgets.layer_order import HEADER, Header, arrange, headers_of, natural_key
from widgets.layers import LayerTable
from widgets.stages import StagesPanel, layer_span, ranges
from widgets.streams import StreamLane, StreamsPanel

NAMES = transformer_names()   # 195
APP_TCSS = Path(__file__).resolve().parent.parent / "console" / "app.tcss"


# --- pure helpers ------------------------------------------------------------------

def test_natural_key_compares_digit_runs_as_numbers():
    assert sorted(["act10", "act2", "act1", "Act3"], key=natural_key) == ["act1", "act2", "Act3", "act10"]
    assert natural_key("blocks.2.attn") < natural_key("blocks.10.attn") < natural_key("blocks.10.ln1")
    assert natural_key("fc9") < natural_key("fc10") < natural_key("head")
    shuffled = NAMES[100:] + NAMES[:100]
    assert [n for n in sorted(shuffled, key=natural_key) if n.endswith(".attn")][:3] == \
        ["blocks.0.attn", "blocks.1.attn", "blocks.2.attn"]


def test_arrange_keeps_the_models_order_and_groups_that_fold():
    rows = layer_rows(NAMES, stages=16)
    assert [r["name"] for r in arrange(rows, "model")] == NAMES             # the step's own order
    assert [r["name"] for r in arrange(rows, "name")][:3] == ["blocks.0.attn", "blocks.0.ln1", "blocks.0.ln2"]
    lines = arrange(rows, "model", grouped=True, folded={"stage 1"})
    headers = [line for line in lines if isinstance(line, Header)]
    assert [h.label for h in headers] == [f"stage {s}" for s in range(16)]
    first = headers[0]
    assert first.layers == 13 and not first.folded
    assert first.fwd_ms == pytest.approx(sum(r["fwd_ms"] for r in rows[:13]))
    assert first.activation_bytes == sum(r["activation_bytes"] for r in rows[:13])
    assert lines[14] is headers[1] and headers[1].folded and lines[15] is headers[2]   # stage 1: header alone
    assert headers_of(lines)["blocks.0.attn"] == HEADER + "stage 0" and "blocks.3.attn" not in headers_of(lines)
    # a filter keeps the groups with a match, and counts what is shown
    attn = arrange(rows, "fwd", filter_text="attn", grouped=True)
    assert isinstance(attn[0], Header) and attn[0].layers == 2 and attn[1]["name"].endswith("attn")
    # sharded: by owner, the layers without parameters last; parameter server: by server
    owned = arrange(layer_rows(NAMES, owners=8), "model", grouped=True)
    labels = [line.label for line in owned if isinstance(line, Header)]
    assert labels == [f"rank {r}" for r in range(8)] + ["no owner"]
    served = arrange([{"name": "fc0", "server": 1}, {"name": "act0"}, {"name": "fc1", "server": 0}], "model",
                     grouped=True)
    assert [line.label if isinstance(line, Header) else line["name"] for line in served] == \
        ["server 0", "fc1", "server 1", "fc0", "no server", "act0"]
    assert arrange([{"name": "fc0"}], "model", grouped=True) == [{"name": "fc0"}]   # nothing to group by


def test_a_stages_layers_are_summarised():
    stages = stage_rows(NAMES, 16)
    assert layer_span(stages[0]["layers"]) == "embed, blocks.0-1"
    assert layer_span(stages[5]["layers"]) == "blocks.10-12"
    assert layer_span(stages[15]["layers"]) == "blocks.30-31, ln_f, head"
    assert layer_span(["fc0", "act0", "fc1", "act1", "head"]) == "fc0-1, act0-1, head"
    assert ranges([7, 0, 1, 2, 5, 8]) == "0-2,5,7-8"


# --- panels alone --------------------------------------------------------------------

def mounted(widget, test, size=(120, 40)) -> None:
    """Mount `widget` alone, focused and repainting at once, and run `test(pilot, widget)`."""
    class Host(App):
        def compose(self) -> ComposeResult:
            yield widget

    async def run() -> None:
        async with Host().run_test(size=size) as pilot:
            for throttle in vars(widget).values():
                if isinstance(throttle, Throttle):
                    throttle.interval_s = 0.0
            widget.focus()
            await pilot.pause()
            await test(pilot, widget)

    asyncio.run(run())


def step_rows(step: int, **kwargs) -> list[dict]:
    return layer_rows(NAMES, stages=16, step=step, **kwargs)


@pytest.mark.timeout(60)
def test_the_layer_under_the_cursor_stays_selected_at_200_layers():
    async def test(pilot, table: LayerTable) -> None:
        table.update_layers(step_rows(1))
        await pilot.pause()
        assert table.shown == NAMES and table.caption() == "sort model"
        table.move_cursor(row=NAMES.index("blocks.17.attn"))
        for step in (2, 3):   # new figures, same order: the cells change, the rows stay
            table.update_layers(step_rows(step))
            await pilot.pause()
            assert table.selected_layer == "blocks.17.attn"
        fwd_ms = step_rows(3)[NAMES.index("blocks.17.attn")]["fwd_ms"]
        assert table.get_cell("blocks.17.attn", "fwd").plain == f"{fwd_ms:.2f}"
        assert table.cycle_sort() == "fwd" and table.selected_layer == "blocks.17.attn"
        for step in (4, 5, 6):   # each step reorders the rows: they move, the cursor with its layer
            table.update_layers(step_rows(step))
            await pilot.pause()
            order = [r["name"] for r in sorted(step_rows(step), key=lambda r: -r["fwd_ms"])]
            assert table.shown == order and [row.key.value for row in table.ordered_rows] == order
            assert table.selected_layer == "blocks.17.attn"
        table.set_filter("blocks.17")
        assert table.shown[0] == "blocks.17.attn" and table.selected_layer == "blocks.17.attn"
        table.update_layers(step_rows(7))
        await pilot.pause()
        assert len(table.shown) == 6 and table.selected_layer == "blocks.17.attn"
        table.set_filter("")
        assert len(table.shown) == 195 and table.selected_layer == "blocks.17.attn"
        table.sort_by("name")
        assert table.shown.index("blocks.2.attn") < table.shown.index("blocks.10.attn")
        assert table.selected_layer == "blocks.17.attn" and "layer ▲" in str(table.columns["name"].label)
        assert [table.cycle_sort() for _ in range(6)] == ["model", "fwd", "bwd", "act", "update", "name"]

    mounted(LayerTable(), test, size=(120, 24))


@pytest.mark.timeout(60)
def test_grouping_by_stage_folds_and_survives_updates():
    async def test(pilot, table: LayerTable) -> None:
        table.update_layers(step_rows(1))
        await pilot.pause()
        table.move_cursor(row=NAMES.index("blocks.3.attn"))
        await pilot.press("g")
        assert table.shown[0] == HEADER + "stage 0" and len(table.shown) == 195 + 16
        assert table.selected_layer == "blocks.3.attn" and table.caption() == "sort model · by stage"
        assert table.get_cell(HEADER + "stage 1", "where").plain == "13 layers"
        assert table.get_cell("blocks.3.attn", "name").plain == "  blocks.3.attn"   # under its header
        await pilot.press("enter")   # on a layer: its group folds, the cursor on the group's header
        assert table.selected_key == HEADER + "stage 1" and table.selected_layer is None
        assert table.get_cell(HEADER + "stage 1", "name").plain == "▸ stage 1"
        assert "blocks.3.attn" not in table.shown and len(table.shown) == 195 + 16 - 13
        for step in (2, 3):   # each second's new rows: stage 1 stays folded, its sums follow
            table.update_layers(step_rows(step))
            await pilot.pause()
            assert table.folded == {"stage 1"} and "blocks.3.attn" not in table.shown
            stage_1 = [r for r in step_rows(step) if r["stage"] == 1]
            assert table.get_cell(HEADER + "stage 1", "fwd").plain == f"{sum(r['fwd_ms'] for r in stage_1):.2f}"
            assert table.selected_key == HEADER + "stage 1"
        table.cycle_sort()   # fwd: sorted within each group, the groups in stage order
        assert table.shown[0] == HEADER + "stage 0" and table.shown[1].endswith(".attn")
        await pilot.press("enter")   # on the header: unfolds
        assert "blocks.3.attn" in table.shown and table.selected_key == HEADER + "stage 1"
        await pilot.press("z")
        assert table.shown == [HEADER + f"stage {s}" for s in range(16)]
        await pilot.press("z")
        assert len(table.shown) == 195 + 16
        await pilot.press("g")   # ungrouped: every layer, no header
        assert len(table.shown) == 195 and table.caption() == "sort fwd"

    mounted(LayerTable(), test, size=(120, 24))


@pytest.mark.timeout(60)
def test_grouping_by_owner_and_nothing_to_group_by():
    async def test(pilot, table: LayerTable) -> None:
        table.update_layers(layer_rows(NAMES, owners=8))
        await pilot.pause()
        await pilot.press("g")
        assert table.caption() == "sort model · by owner"
        assert [k for k in table.shown if k.startswith(HEADER)][-1] == HEADER + "no owner"
        table.update_layers([{"name": "fc0", "fwd_ms": 1.0}, {"name": "act0", "fwd_ms": 0.5}])
        await pilot.pause()
        assert table.shown == ["fc0", "act0"]                 # grouped, but nothing to group by
        await pilot.press("g", "g")                          # off; on again is refused with a word
        assert not table.grouped and table.shown == ["fc0", "act0"]
        await pilot.press("enter")                           # not grouped: Enter folds nothing
        assert table.shown == ["fc0", "act0"] and table.selected_layer == "fc0"

    mounted(LayerTable(), test, size=(120, 24))


def render_lines(panel) -> list[str]:
    return panel.render().plain.splitlines()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("count", [8, 16])
def test_stages_show_every_stage_with_its_layers_summarised(count):
    async def test(pilot, panel: StagesPanel) -> None:
        stages = stage_rows(NAMES, count)
        panel.update_stages(stages, "pipeline", threshold_ms=8.0)
        await pilot.pause()
        lines = render_lines(panel)
        assert len(lines) == count + 1 and panel.size.height == count + 1
        for stage, line in zip(stages, lines[1:]):
            assert line.startswith(f"stage {stage['stage']} ")
            span = f"{layer_span(stage['layers'])} ({len(stage['layers'])})"
            assert span in line and stage["layers"][1] not in line     # summarised, never listed
            assert line.endswith(" ms")
        bars = {line.count("█") + line.count("░") for line in lines[1:]}
        assert len(bars) == 1 and bars.pop() >= 10                     # one scale, one width

    mounted(StagesPanel(), test, size=(78, 24))


@pytest.mark.timeout(60)
def test_stages_shorter_than_their_panel_say_how_many_more():
    async def test(pilot, panel: StagesPanel) -> None:
        panel.styles.max_height = 10
        panel.update_stages(stage_rows(NAMES, 16), "pipeline")
        await pilot.pause()
        lines = render_lines(panel)
        assert len(lines) == 10 and lines[8].startswith("stage 7 ")
        assert lines[-1] == "… 8 more: stages 8-15"
        # too narrow for the summaries: the bars alone
        panel.styles.width = 44
        await pilot.pause()
        assert "blocks" not in panel.render().plain and "█" in render_lines(panel)[1]

    mounted(StagesPanel(), test, size=(78, 24))


@pytest.mark.timeout(60)
def test_streams_show_eight_lanes_with_a_bar_per_step():
    async def test(pilot, panel: StreamsPanel) -> None:
        steps = [stream_entries(8, step) for step in range(1, 13)]
        panel.update_streams(steps[-1], "sharded", steps)
        await pilot.pause()
        lanes = list(panel.query(StreamLane))
        assert [lane.stream for lane in lanes] == list(range(8))
        assert all(lane.spark.data == [e["bytes"] for e in (s[lane.stream] for s in steps)] for lane in lanes)
        assert panel.size.height == 9 and panel.max_scroll_y == 0   # caption and 8 lanes: nothing hidden
        text = "\n".join(render_lines_of(pilot))
        assert "stream 7" in text and "32.0 MiB" in text and "94%" in text

    mounted(StreamsPanel(), test, size=(78, 12))


def render_lines_of(pilot) -> list[str]:
    strips = pilot.app.screen._compositor.render_strips()
    return ["".join(segment.text for segment in strip) for strip in strips]


# --- the console's keys ------------------------------------------------------------------

class LiveKeys(ConsoleApp):
    """A replay whose command keys act as in a live run (a replay hides them): they reach the actions."""

    CSS_PATH = APP_TCSS   # a relative path would be read beside this file

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        return True


@pytest.mark.timeout(60)
def test_layer_keys_on_a_group_header_say_no_layer_is_selected(tmp_path):
    feed = write_feed(tmp_path / "llm_pipe.jsonl", pipeline_records(16, steps=3))

    async def run() -> None:
        app = LiveKeys(ReplaySource(feed, paused=True, preload=4))
        async with app.run_test(size=(200, 50)) as pilot:
            deadline = time.monotonic() + 10
            while not app.replay_ready and time.monotonic() < deadline:
                await pilot.pause(0.05)
            app.refresh_panels(force=True)
            await pilot.pause(0.4)
            table = app.table
            assert table.has_focus and table.shown == NAMES
            await pilot.press("g")   # grouped: the cursor stays on its layer, embed, under stage 0's header
            assert table.selected_layer == "embed" and table.border_subtitle == "sort model · by stage"
            await pilot.press("up")
            assert table.selected_key == HEADER + "stage 0"
            for key in "kscu":
                await pilot.press(key)
            said = [line.text for line in app.event_log.lines if "no layer selected" in line.text]
            assert len(said) == 4
            for line, what in zip(said, ("set-policy keep", "set-policy swap", "set-policy recompute", "set-placement")):
                assert line.endswith(f"{what}: no layer selected — pick one in the Layers panel")
            await pilot.press("down", "k")   # a layer: the command goes out (a replay refuses it)
            assert app.event_log.lines[-1].text.endswith("replay: commands are disabled")
            await pilot.press("question_mark")
            keys = [key for key, _ in app.screen.keys]
            assert {"g", "enter", "z", "o"} <= set(keys)

    asyncio.run(run())


# --- snapshots: each panel alone, styled as in the console ------------------------------

class Panel(App):
    """One console panel with its id, class and titles, styled by console/app.tcss."""

    CSS_PATH = APP_TCSS

    def __init__(self, panel) -> None:
        super().__init__()
        self.panel = panel

    def compose(self) -> ComposeResult:
        yield self.panel

    def on_mount(self) -> None:
        self.panel.add_class("panel")
        self.panel.border_title = self.panel.id.title()
        self.panel.focus()


async def settle(pilot) -> None:
    """Until the table (if any) has measured its rows: a snapshot of the columns before would be racy."""
    await pilot.pause(0.2)
    for table in pilot.app.query(LayerTable):
        deadline = time.monotonic() + 5
        while (table._require_update_dimensions or table._new_rows) and time.monotonic() < deadline:
            await pilot.pause(0.05)
    await pilot.pause(0.1)


def layers_grouped_with_stage_1_folded():
    async def run_before(pilot) -> None:
        table = pilot.app.panel
        table.repaint.interval_s = 0.0
        table.update_layers(step_rows(1))
        await pilot.pause()
        await pilot.press("g", *["down"] * 16, "enter")   # a layer of stage 1: its group folds
        table.update_layers(step_rows(2))                 # and stays folded
        await settle(pilot)
    return run_before


@pytest.mark.timeout(60)
def test_layers_panel_grouped_by_stage_snapshot(snap_compare):
    app = Panel(LayerTable(id="layers"))
    assert snap_compare(app, terminal_size=(110, 30), run_before=layers_grouped_with_stage_1_folded())


@pytest.mark.timeout(60)
def test_stages_panel_at_16_stages_snapshot(snap_compare):
    async def run_before(pilot) -> None:
        pilot.app.panel.update_stages(stage_rows(NAMES, 16), "pipeline", threshold_ms=8.0)
        await settle(pilot)
    # a 200-column console's left column, 40 rows high: the panel may take half of them
    assert snap_compare(Panel(StagesPanel(id="stages")), terminal_size=(80, 40), run_before=run_before)


@pytest.mark.timeout(60)
def test_streams_panel_at_8_streams_snapshot(snap_compare):
    async def run_before(pilot) -> None:
        steps = [stream_entries(8, step) for step in range(1, 13)]
        pilot.app.panel.update_streams(steps[-1], "sharded", steps)
        await settle(pilot)
    assert snap_compare(Panel(StreamsPanel(id="streams")), terminal_size=(80, 12), run_before=run_before)
