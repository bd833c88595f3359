"""The console's widgets, alone: pure helpers, then each widget mounted in a tiny App.

Run: `python -m pytest tests/test_widgets.py -q`. No pytest-asyncio: each Pilot test
runs its coroutine with `asyncio.run`.
"""

from __future__ import annotations

import asyncio

import pytest
from textual.app import App, ComposeResult
from textual.widget import Widget

from widgets import (Curves, DeviceCard, DevicesPanel, EventLog, LayerTable, StagesPanel,
                     StreamsPanel, human_bytes, segment_bar)

MIB, GIB = 2**20, 2**30
REPAINT_WAIT_S = 0.35   # panels repaint at most 4 times a second


def rank_entry(rank: int, used: int = 20 * MIB, capacity: int = 64 * MIB, **extra) -> dict:
    quarter = used // 4
    return {"rank": rank, "parameters_bytes": quarter, "gradients_bytes": quarter,
            "optimizer_state_bytes": quarter, "activations_bytes": used - 3 * quarter,
            "swapped_bytes": 0, "used_bytes": used, "peak_bytes": used, "capacity_bytes": capacity,
            "over_capacity": False, "rss_bytes": 400 * MIB, "cpu_percent": 50.0, **extra}


def layer(name: str, fwd: float, bwd: float = 0.1, act: int = MIB) -> dict:
    return {"name": name, "fwd_ms": fwd, "bwd_ms": bwd, "activation_bytes": act}


def mounted(widget: Widget, test, size=(120, 40)) -> None:
    """Mount `widget` alone in an App and run `test(pilot, widget)` against it."""
    class Host(App):
        def compose(self) -> ComposeResult:
            yield widget

    async def run() -> None:
        async with Host().run_test(size=size) as pilot:
            await pilot.pause()
            await test(pilot, widget)

    asyncio.run(run())


def screen_text(pilot) -> str:
    strips = pilot.app.screen._compositor.render_strips()
    return "\n".join("".join(segment.text for segment in strip) for strip in strips)


# --- pure helpers ----------------------------------------------------------------

def cells_styled(text, style: str) -> int:
    return sum(span.end - span.start for span in text.spans if str(span.style) == style)


@pytest.mark.timeout(60)
def test_segment_bar_widths_are_proportional_and_fill_the_width():
    bar = segment_bar([(25, "red"), (50, "blue")], capacity=100, width=40, peak=None)
    assert bar.plain == "█" * 30 + "░" * 10
    assert cells_styled(bar, "red") == 10 and cells_styled(bar, "blue") == 20
    # running-total rounding: three thirds of the capacity fill the bar exactly
    assert segment_bar([(1, "a"), (1, "b"), (1, "c")], 3, 10, None).plain == "█" * 10


@pytest.mark.timeout(60)
def test_segment_bar_peak_mark_and_over_capacity():
    bar = segment_bar([(30, "red")], capacity=100, width=20, peak=50)
    assert len(bar) == 20 and bar.plain.index("┃") == 10
    assert segment_bar([(10, "red")], 100, 20, peak=100).plain.index("┃") == 19
    over = segment_bar([(150, "red")], capacity=100, width=20, peak=150)
    assert len(over) == 20 and over.plain.endswith("▶") and "░" not in over.plain
    assert cells_styled(over, "bold red") == 1
    assert segment_bar([], capacity=0, width=5, peak=None).plain == "░" * 5


@pytest.mark.timeout(60)
def test_human_bytes():
    assert human_bytes(0) == "0 B"
    assert human_bytes(1023) == "1023 B"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(64 * MIB) == "64.0 MiB"
    assert human_bytes(300 * MIB) == "300 MiB"
    assert human_bytes(3 * 2**30) == "3.0 GiB"
    assert human_bytes(None) == "—"


# --- widgets in an App -----------------------------------------------------------

@pytest.mark.timeout(60)
def test_panels_say_when_they_have_no_data():
    class Panels(App):
        def compose(self) -> ComposeResult:
            yield DevicesPanel()
            yield StreamsPanel()
            yield StagesPanel()
            yield LayerTable()
            yield Curves()

    async def run() -> None:
        async with Panels().run_test(size=(120, 40)) as pilot:
            app = pilot.app
            app.query_one(DevicesPanel).update_ranks(None, True)
            app.query_one(StreamsPanel).update_streams([], "pipeline")
            app.query_one(StagesPanel).update_stages(None, "ddp")
            app.query_one(LayerTable).update_layers(None)
            await pilot.pause()
            text = screen_text(pilot)
            for message in ("no device data yet", "no communication streams in mode pipeline",
                            "no pipeline stages in mode ddp", "no layer timings yet", "no steps yet"):
                assert message in text, message
            assert app.query_one(LayerTable).selected_layer is None

    asyncio.run(run())


@pytest.mark.timeout(60)
def test_device_card_simulated_and_over_capacity():
    async def test(pilot, panel: DevicesPanel) -> None:
        over = rank_entry(1, used=70 * MIB, peak_bytes=72 * MIB, over_capacity=True)
        panel.update_ranks([rank_entry(0), over], simulated=True)
        await pilot.pause()
        cards = list(panel.query(DeviceCard))
        assert [card.rank for card in cards] == [0, 1]
        text = screen_text(pilot)
        assert "simulated" in text and "OVER" in text and "GPU" not in text
        assert "used 70.0 MiB / cap 64.0 MiB" in text
        assert cards[1].has_class("-crit") and not cards[0].has_class("-crit")
        # same ranks again: updated in place (at the next repaint), not remounted
        panel.update_ranks([rank_entry(0, used=55 * MIB), over], simulated=True)
        await pilot.pause(REPAINT_WAIT_S)
        assert list(panel.query(DeviceCard)) == cards and cards[0].has_class("-warn")
        assert "owns" not in screen_text(pilot)
        before = cards[0].size.height
        # sharded ranks also show their shard and their wait at the broadcast gate, on a line of its own
        panel.update_ranks([rank_entry(0, owned_bytes=3 * MIB, gate_ms=1.25), over], simulated=True)
        await pilot.pause(REPAINT_WAIT_S)
        assert "owns 3.0 MiB  gate 1.2 ms" in screen_text(pilot)
        assert cards[0].size.height == before + 1
        # a rank whose layers swap or recompute says how many, and what it sent to the host in the step
        panel.update_ranks([rank_entry(0, owned_bytes=3 * MIB, gate_ms=1.25, swap_layers=3, recompute_layers=2,
                                       swapped_out_bytes=5 * MIB, link_wait_ms=12.34), over], simulated=True)
        await pilot.pause(REPAINT_WAIT_S)
        assert "swap 3  recompute 2  to host 5.0 MiB/step  wait 12.3 ms" in screen_text(pilot)
        assert cards[0].size.height == before + 2

    mounted(DevicesPanel(), test)


@pytest.mark.timeout(60)
def test_device_card_on_a_gpu_shows_nvml():
    async def test(pilot, card: DeviceCard) -> None:
        card.update_data(rank_entry(3, nvml_used_bytes=3 * 2**30, nvml_total_bytes=80 * 2**30,
                                    gpu_util_percent=45.0), simulated=False)
        await pilot.pause()
        text = screen_text(pilot)
        assert "GPU" in text and "simulated" not in text
        assert "nvml 3.0 / 80.0 GiB" in text and "util 45%" in text

    mounted(DeviceCard(3), test)


def cuda_entry(rank: int, **extra) -> dict:
    """A CUDA rank as the engine sends it: the ledger's keys, then the allocator's and NVML's."""
    gpu = {"allocated_bytes": 3 * GIB, "reserved_bytes": 4 * GIB, "allocator_peak_bytes": 3584 * MIB,
           "nvml_used_bytes": 4608 * MIB, "nvml_total_bytes": 80 * GIB, "gpu_util_percent": 87.0}
    return rank_entry(rank, used=2560 * MIB, capacity=80 * GIB, **{**gpu, **extra})


@pytest.mark.timeout(60)
def test_device_card_on_a_gpu_shows_its_name_the_allocator_and_what_the_ledger_does_not_explain():
    async def test(pilot, panel: DevicesPanel) -> None:
        names = ["NVIDIA H100 80GB HBM3", "cpu (simulated device: memory from the engine's ledger)"]
        panel.update_ranks([cuda_entry(0), rank_entry(1)], simulated=False, names=names)
        await pilot.pause(REPAINT_WAIT_S)
        gpu, cpu = list(panel.query(DeviceCard))
        gpu_text, cpu_text = (card.render().plain for card in (gpu, cpu))
        assert gpu_text.splitlines()[0] == "NVIDIA H100 80GB HBM3"
        assert "ledger 2.5 GiB / cap 80.0 GiB" in gpu_text
        assert "alloc 3.0 GiB  peak 3.5 GiB" in gpu_text and "reserved 4.0 GiB" in gpu_text
        assert "unexplained +512 MiB" in gpu_text          # allocated 3 GiB - ledger 2.5 GiB
        assert "nvml 4.5 / 80.0 GiB  util 87%" in gpu_text
        assert "rss 400 MiB  cpu 50%" in gpu_text
        # a CPU rank's card is today's: no name, no allocator, no NVML, no gap
        assert cpu_text.splitlines()[2] == "used 20.0 MiB / cap 64.0 MiB"
        for word in ("cpu (simulated", "alloc", "reserved", "unexplained", "nvml", "ledger"):
            assert word not in cpu_text, word
        # every line has its row: none clipped
        assert gpu.size.height == len(gpu_text.splitlines()) == DeviceCard.height_for(cuda_entry(0), {}, names[0])
        assert cpu.size.height == len(cpu_text.splitlines()) == 5
        # the ledger counting more than the allocator holds: a negative gap, its sign shown; no NVML: no line
        no_nvml = {k: v for k, v in cuda_entry(0, allocated_bytes=2 * GIB).items() if not k.startswith(("nvml", "gpu"))}
        panel.update_ranks([no_nvml, rank_entry(1)], simulated=False, names=names)
        await pilot.pause(REPAINT_WAIT_S)
        gpu_text = gpu.render().plain
        assert "unexplained -512 MiB" in gpu_text and "nvml" not in gpu_text
        assert gpu.size.height == len(gpu_text.splitlines())
        # an old log's hello has no `devices`: the card goes without the name
        panel.update_ranks([cuda_entry(0), rank_entry(1)], simulated=False)
        await pilot.pause(REPAINT_WAIT_S)
        assert gpu.render().plain.splitlines()[0].startswith("█")

    mounted(DevicesPanel(), test)


@pytest.mark.timeout(60)
def test_layer_table_filter_sort_and_selection_kept():
    async def test(pilot, table: LayerTable) -> None:
        table.update_layers([layer("fc0", 1.0), layer("fc1", 3.0), layer("head", 2.0), layer("fc10", 0.5)])
        await pilot.pause()
        assert table.shown == ["fc0", "fc1", "head", "fc10"]   # the model's order: the rows as given
        table.move_cursor(row=1)
        assert table.selected_layer == "fc1"
        assert table.cycle_sort() == "fwd"
        assert table.shown == ["fc1", "head", "fc0", "fc10"] and table.selected_layer == "fc1"
        assert "fwd ms ▼" in screen_text(pilot)
        # new timings reorder the rows (at the next repaint): the cursor follows the layer
        table.update_layers([layer("fc0", 9.0), layer("fc1", 3.0), layer("head", 2.0), layer("fc10", 0.5)])
        await pilot.pause(REPAINT_WAIT_S)
        assert table.shown[:2] == ["fc0", "fc1"] and table.selected_layer == "fc1"
        # same order: cells change in place
        table.update_layers([layer("fc0", 8.0), layer("fc1", 3.0), layer("head", 2.0), layer("fc10", 0.5)])
        await pilot.pause(REPAINT_WAIT_S)
        assert table.get_cell("fc0", "fwd").plain == "8.00" and table.selected_layer == "fc1"
        # a wider figure in place widens its column (only wider cells are measured)
        table.update_layers([layer("fc0", 12345.0), layer("fc1", 3.0), layer("head", 2.0), layer("fc10", 0.5)])
        await pilot.pause(REPAINT_WAIT_S)
        assert table.columns["fwd"].content_width >= len("12345.00")
        assert "12345.00" in screen_text(pilot)
        table.set_filter("FC1")
        assert table.shown == ["fc1", "fc10"] and table.selected_layer == "fc1"
        table.set_filter("zz")
        assert table.shown == [] and table.selected_layer is None
        table.set_filter("")
        assert len(table.shown) == 4
        table.sort_by("act")
        with pytest.raises(ValueError):
            table.sort_by("colour")
        await pilot.pause()
        assert table.get_cell("fc0", "policy").plain == "—"

    mounted(LayerTable(), test)


@pytest.mark.timeout(60)
def test_streams_one_lane_per_stream():
    async def test(pilot, panel: StreamsPanel) -> None:
        for step in range(70):
            panel.update_streams([{"stream": i, "bytes": 1000 * step, "busy_ms": 1.0,
                                   "busy_fraction": 0.5, "in_flight": i} for i in range(3)], "pipeline")
        await pilot.pause()
        lanes = list(panel.lanes.values())
        assert [lane.stream for lane in lanes] == [0, 1, 2]
        assert all(len(lane.history) == 60 for lane in lanes)
        text = screen_text(pilot)
        assert "stream 2" in text and "50%" in text and "reduce" not in text
        # the figures the run declares this panel shows, over the lanes
        panel.update_streams([{"stream": 0, "bytes": 10, "busy_fraction": 0.5, "in_flight": 0}], "sharded",
                             figures=[("reduce", "ms", 0.5), ("broadcast wait", "ms", 1.25),
                                      ("on the wire", "bytes", 1536)])
        await pilot.pause()
        lines = screen_text(pilot).splitlines()
        assert lines[1].startswith("reduce 0.50 ms · broadcast wait 1.25 ms · on the wire 1.5 KiB")
        assert lines[2].startswith("stream 0")
        panel.update_streams(None, "ddp")
        await pilot.pause()
        text = screen_text(pilot)
        assert "no communication streams in mode ddp" in text and "reduce" not in text

    mounted(StreamsPanel(), test)


@pytest.mark.timeout(60)
def test_stages_bars_and_imbalance():
    async def test(pilot, panel: StagesPanel) -> None:
        stages = [{"stage": 0, "fwd_ms": 1.0, "bwd_ms": 2.0, "idle_ms": 1.0, "micro_batches": 2},
                  {"stage": 1, "fwd_ms": 2.0, "bwd_ms": 4.0, "idle_ms": 0.0, "micro_batches": 2}]
        panel.update_stages(stages, "pipeline", imbalance_ms=3.0, threshold_ms=1.0, migrating=True)
        await pilot.pause()
        text = screen_text(pilot)
        assert "stage 0" in text and "stage 1" in text and "⟳ rebalancing" in text
        assert "imbalance 3.00 ms > threshold 1.00 ms" in text and "ms/step  2 micro-batches/step" in text
        assert "recv wait" not in text and panel.size.height == 3
        # the figures the run declares this panel shows, each stage's from its rank, under their labels
        panel.update_stages(stages, "pipeline", imbalance_ms=3.0, threshold_ms=1.0, migrating=True,
                            figures=[[("recv wait", "ms", 0.25), ("sent", "bytes", 2048)], [("recv wait", "ms", 1.5)]])
        await pilot.pause()
        header, labels, first, second = screen_text(pilot).splitlines()[:4]
        assert labels.rstrip().endswith("· recv wait · sent") and panel.size.height == 4
        assert first.rstrip().endswith("1.0/2.0/1.0 ms · 0.25 ms · 2.0 KiB")
        assert second.rstrip().endswith("2.0/4.0/0.0 ms · 1.50 ms") and "stage 1" in second
        # stages x replicas: a stage's line is its slowest replica's, and says its replicas' spread
        replicated = [{**s, "replicas_ms": [s["fwd_ms"] + s["bwd_ms"], s["fwd_ms"] + s["bwd_ms"] - 0.5]}
                      for s in stages]
        panel.update_stages(replicated, "pipeline", imbalance_ms=3.0, threshold_ms=1.0, migrating=False)
        await pilot.pause()
        first, second = screen_text(pilot).splitlines()[1:3]
        assert first.rstrip().endswith("1.0/2.0/1.0 ms · 2× 2.5-3.0")
        assert second.rstrip().endswith("2.0/4.0/0.0 ms · 2× 5.5-6.0")

    mounted(StagesPanel(), test)


async def redrawn(pilot, curves: Curves) -> None:
    # big plots redraw less often than 4 times a second: a render that took 0.5 s on a loaded machine puts the
    # next one 5 s later (PLOT_SHARE), so wait up to 30 s
    for _ in range(300):
        await pilot.pause(0.1)
        if not curves.dirty:
            break
    await pilot.pause()
    assert not curves.dirty


@pytest.mark.timeout(60)
def test_curves_take_many_points():
    async def test(pilot, curves: Curves) -> None:
        for step in range(1, 1001):
            curves.add_point(step, 2.0 / step, 1000.0 + step)
        assert len(curves.steps) == 500 and curves.steps[-1] == 1000
        await redrawn(pilot, curves)   # one throttled redraw
        assert curves.loss_plot.display
        curves.add_point(900, 0.5, 10.0)   # a restart replays from step 900
        assert curves.steps[-1] == 900 and curves.steps[-2] == 899
        curves.add_point(901, float("nan"), float("inf"))   # a diverged run must not break plotting
        await redrawn(pilot, curves)   # an exception in the render fails the test at exit
        curves.clear()
        await redrawn(pilot, curves)
        assert not curves.loss_plot.display

    mounted(Curves(), test)


@pytest.mark.timeout(60)
def test_event_log_formats_commands_and_events():
    async def test(pilot, log: EventLog) -> None:
        log.add_event({"type": "event", "kind": "command", "step": 7, "name": "set-policy",
                       "args": ["fc9", "recompute"], "status": "rejected", "reason": "unknown layer 'fc9'"})
        log.add_event({"type": "event", "kind": "command", "step": 8, "name": "pause", "args": [],
                       "status": "applied"})
        log.add_event({"type": "event", "kind": "checkpoint", "step": 100, "path": "runs/x/step_000100"})
        log.add_text("connection lost", "red")
        log.add_event({"type": "event", "kind": "rebalance", "step": 10, "reason": "auto",
                       "stages": [["a", "b"], ["c"]], "stage_ms": [1.0, 7.5], "predicted_ms": [4.0, 4.5]})
        log.add_event({"type": "event", "kind": "migration", "step": 11, "bytes": 2048, "duration_ms": 12.4,
                       "moves": [{"layer": "b", "from_stage": 1, "to_stage": 0}], "stages": [["a", "b"], ["c"]]})
        await pilot.pause()
        lines = ["".join(segment.text for segment in strip) for strip in log.lines]
        assert "auto: slowest stage 7.5 -> 4.5 ms, new stages 2|1 layers" in lines[4]
        assert "1 layer(s) moved (b 1→0), 2.0 KiB in 12 ms; stages 2|1" in lines[5]
        assert "set-policy fc9 recompute rejected: unknown layer 'fc9'" in lines[0]
        assert "step      7" in lines[0]
        assert "pause applied at step 8" in lines[1]
        assert "checkpoint" in lines[2] and "runs/x/step_000100" in lines[2]
        assert "connection lost" in lines[3]
        red = [s for s in log.lines[0] if "rejected" in s.text or s.text.strip() == "command"]
        assert red and all(s.style.color.name == "red" for s in red)

    mounted(EventLog(), test)


# --- parameter server --------------------------------------------------------------

def ps_record(lost: tuple[int, ...] = ()) -> dict:
    """A param_server step's `ps`: servers 0 and 1, workers on ranks 2-5, rank 5 emulated 3x slower."""
    workers = [{"rank": rank, "iterations": 120 if rank < 5 else 40, "steps_per_s": 10.5 if rank < 5 else 3.5,
                "wait_ms": 3.2, "compute_ms": 20.1, "slow_factor": 1.0 if rank < 5 else 3.0,
                "alive": rank not in lost} for rank in (2, 3, 4, 5)]
    live = 4 - len(lost)
    return {"mode": "soft", "staleness_bound": 2, "workers_live": live, "workers_lost": list(lost),
            "workers": workers,
            "layers": [{"name": "fc0", "server": 0, "version": 118, "window_workers": 3, "mean_staleness": 0.25,
                        "window_ms": 4.2},
                       {"name": "fc1", "server": 1, "version": 117, "window_workers": live, "mean_staleness": 2.5,
                        "window_ms": 3.1},
                       {"name": "head", "server": 0, "version": 118, "window_workers": live, "mean_staleness": 0.0,
                        "window_ms": 1.3}]}


@pytest.mark.timeout(60)
def test_layer_table_shows_each_layers_sync_window_in_param_server_mode():
    rows = [layer("fc0", 1.0), layer("act0", 0.1), layer("fc1", 2.0), layer("head", 0.5)]

    async def test(pilot, table: LayerTable) -> None:
        table.update_layers(rows, ps=ps_record())
        await pilot.pause()
        titles = [str(column.label) for column in table.columns.values()]
        assert titles == ["layer", "server", "fwd ms", "bwd ms", "version", "workers", "stale", "win ms"]
        cell = table.get_cell
        assert [cell("fc0", key).plain for key in ("server", "version", "workers", "staleness", "window")] == \
            ["0", "118", "3/4", "0.25", "4.20"]
        assert cell("fc0", "workers").style == "#ffb000"      # a worker missed the window
        assert cell("fc1", "staleness").style == "bold red"   # staler than the bound on average
        assert [cell("act0", key).plain for key in ("server", "version", "workers", "staleness", "window")] == \
            [""] * 5                                          # no parameters: nothing to synchronise
        assert "3/4" in screen_text(pilot) and "policy" not in screen_text(pilot)
        assert table.cycle_sort() == "fwd" and table.cycle_sort() == "bwd" and table.cycle_sort() == "staleness"
        assert table.shown[0] == "fc1"
        # another mode again: the policy columns come back
        table.update_layers(rows)
        await pilot.pause(REPAINT_WAIT_S)
        assert "policy" in [str(column.label) for column in table.columns.values()]
        # before the first timed step the layers come from `ps` alone
        table.update_layers(None, ps=ps_record(lost=(5,)))
        await pilot.pause(REPAINT_WAIT_S)
        assert sorted(table.shown) == ["fc0", "fc1", "head"] and table.get_cell("fc1", "workers").plain == "3/3"

    mounted(LayerTable(), test)


@pytest.mark.timeout(60)
def test_device_cards_by_role_with_worker_pace_and_a_lost_worker():
    roles = ["server", "server", "worker", "worker", "worker", "worker"]
    ranks = [rank_entry(rank, role=role) for rank, role in enumerate(roles)]

    async def test(pilot, panel: DevicesPanel) -> None:
        panel.update_ranks(ranks, simulated=True, ps=ps_record())
        await pilot.pause()
        cards, text = list(panel.query(DeviceCard)), screen_text(pilot)
        for rank, label in enumerate(["server 0", "server 1", "worker 0", "worker 1", "worker 2", "worker 3"]):
            assert f"{label} rank {rank} simulated" in text   # the CPU device says what it is
        assert "GPU" not in text
        assert str(cards[0].render()).startswith("serves fc0, head") and "serves fc1" in str(cards[1].render())
        fast, slow = str(cards[2].render()), str(cards[5].render())
        assert fast.startswith("10.5 steps/s  wait 3.2 ms") and "slower" not in fast
        assert slow.startswith("3.5 steps/s  wait 3.2 ms\n3.0x slower (emulated)")
        assert "used 20.0 MiB / cap 64.0 MiB" in slow      # the ledger's lines stay
        # rank 5 is lost and sends no ledger row any more: its card stays and says so
        panel.update_ranks(ranks[:5], simulated=True, ps=ps_record(lost=(5,)))
        await pilot.pause(REPAINT_WAIT_S)
        cards = list(panel.query(DeviceCard))
        assert len(cards) == 6 and cards[5].has_class("-lost") and "LOST" in str(cards[5].border_subtitle)
        assert str(cards[5].render()) == "lost after 40 iterations\n3.0x slower (emulated)"
        assert "lost after 40 iterations" in screen_text(pilot)

    panel = DevicesPanel()
    panel.MAX_CARDS = 6   # the cards' own lines (6 ranks are a table by default: tests/test_device_table.py)
    mounted(panel, test, size=(80, 80))


@pytest.mark.timeout(60)
def test_event_log_formats_param_server_events():
    async def test(pilot, log: EventLog) -> None:
        log.add_event({"type": "event", "kind": "sync_mode", "step": 0, "mode": "soft", "previous": None,
                       "source": "config"})
        log.add_event({"type": "event", "kind": "sync_mode", "step": 12, "mode": "bsp", "previous": "soft",
                       "source": "command"})
        log.add_event({"type": "event", "kind": "worker_lost", "step": 26, "rank": 5, "reason": "process exited"})
        log.add_event({"type": "event", "kind": "ps_profile", "step": 5,
                       "layers": [{"name": "fc0", "window_ms": [0.0, 0.0]}, {"name": "fc1", "window_ms": [1.6, 4.9]}]})
        await pilot.pause()
        lines = ["".join(segment.text for segment in strip) for strip in log.lines]
        assert "sync       sync mode soft (from config)" in lines[0]
        assert "sync mode soft -> bsp (from command)" in lines[1]
        assert "lost       worker rank 5 lost: process exited" in lines[2]
        assert "sync windows per worker: fc0 0.0 ms, fc1 1.6–4.9 ms" in lines[3]

    mounted(EventLog(), test)


@pytest.mark.timeout(60)
def test_event_log_formats_the_plans_and_an_operators_policy_and_placement():
    async def test(pilot, log: EventLog) -> None:
        log.add_event({"type": "event", "kind": "memory_plan", "step": 3, "planner": "ratio", "capacity_bytes": 8 << 20,
                       "ranks": [{"rank": 1, "swap_layers": 2, "recompute_layers": 6, "estimate_bytes": 3 << 20}],
                       "policies": {"embed": "keep"}, "host_link_gbps": 10.6, "note": ""})
        log.add_event({"type": "event", "kind": "update_plan", "step": 4, "planner": "global",
                       "placement": {"embed": "device", "block0.attn": "host", "block0.mlp": "host"},
                       "predicted_ms": 57.01, "all_device_ms": 57.2, "all_host_ms": 61.2, "profile": "p.json"})
        log.add_event({"type": "event", "kind": "policy", "step": 9, "layer": "block0.mlp", "policy": "recompute",
                       "source": "command"})
        log.add_event({"type": "event", "kind": "placement", "step": 9, "layer": "head", "placement": "host",
                       "source": "command"})
        await pilot.pause()
        text = "\n".join("".join(segment.text for segment in strip) for strip in log.lines)
        assert "mem plan   ratio: rank 1: 2 swap, 6 recompute, modelled peak 3.0 MiB of 8.0 MiB" in text
        assert ("upd plan   global: 2 of 3 updates on the host; modelled step 57.0 ms (all device 57.2, all "
                "host 61.2)") in text
        assert "policy     block0.mlp -> recompute (from command)" in text
        assert "placement  head -> host (from command)" in text

    mounted(EventLog(), test, size=(160, 20))


@pytest.mark.timeout(60)
def test_event_log_says_in_words_when_a_step_was_skipped_or_rolled_back():
    async def test(pilot, log: EventLog) -> None:
        log.add_event({"type": "event", "kind": "step_skipped", "step": 120, "grad_norm": None, "redone_layers": 14})
        log.add_event({"type": "event", "kind": "step_rolled_back", "step": 87, "grad_norm": 3.2, "clip": 1.0,
                       "redone_layers": 14})
        log.add_event({"type": "event", "kind": "step_skipped", "step": 121, "grad_norm": float("inf"),
                       "redone_layers": 1})
        log.add_event({"type": "event", "kind": "step_rolled_back", "step": 88, "grad_norm": 0.0123, "clip": 0.01,
                       "redone_layers": 0})
        await pilot.pause()
        lines = ["".join(segment.text for segment in strip) for strip in log.lines]
        assert "step    120 skipped    gradient norm not finite; 14 layers rolled back" in lines[0]
        assert ("step     87 rollback   gradient norm 3.2 over clip 1.0, 14 layers redone with the clipped "
                "gradient") in lines[1]
        assert "step    121 skipped    gradient norm not finite; 1 layer rolled back" in lines[2]
        assert "gradient norm 0.0123 over clip 0.01, 0 layers redone" in lines[3]

    mounted(EventLog(), test, size=(160, 20))


@pytest.mark.timeout(60)
def test_event_log_lines_written_before_it_has_a_size_wrap_at_its_width():
    # the console writes the preloaded events at once, maybe before the first layout
    class Host(App):
        def compose(self) -> ComposeResult:
            self.log_ = EventLog()
            yield self.log_

        def on_mount(self) -> None:
            self.log_.add_text("checkpoint saved " + "runs/digits-ddp/checkpoints/step_000020 " * 2)

    async def run() -> None:
        app = Host()
        async with app.run_test(size=(60, 10)) as pilot:
            await pilot.pause(0.1)
            log = app.log_
            assert len(log.lines) > 1 and log.virtual_size.width <= log.scrollable_content_region.width
    asyncio.run(run())


@pytest.mark.timeout(60)
def test_a_lane_has_one_bar_per_step_however_often_it_is_drawn():
    from console.state import RunState
    state = RunState()
    for step in range(1, 6):   # five steps arrive between two draws
        state.apply({"type": "step", "step": step, "loss": 1.0,
                     "streams": [{"stream": 0, "bytes": 100 * step, "busy_fraction": 0.1, "in_flight": 0}]})
    state.apply({"type": "snapshot", "last_step": state.last_step})   # a reconnect repeats the last step
    pending = state.take_stream_steps()
    assert [entries[0]["bytes"] for entries in pending] == [100, 200, 300, 400, 500]
    assert state.take_stream_steps() == []

    async def test(pilot, panel: StreamsPanel) -> None:
        panel.update_streams(state.last_step["streams"], "ddp", pending)
        panel.update_streams(state.last_step["streams"], "ddp", [])   # drawn again, no new step
        await pilot.pause()
        assert list(panel.lanes[0].history) == [100, 200, 300, 400, 500]
        assert panel.lanes[0].spark.data == [100, 200, 300, 400, 500]

    mounted(StreamsPanel(), test)


@pytest.mark.timeout(60)
def test_a_card_names_the_fp32_masters_and_the_blocks_shared_inputs_only_where_a_rank_keeps_some():
    """bf16 weights (precision.params): the masters are a category of their own on the bar and its legend; so
    are the inputs a model's blocks share (masks, rotary tables)."""
    async def test(pilot, card: DeviceCard) -> None:
        card.update_data(rank_entry(3), simulated=True)
        await pilot.pause()
        assert "■param ■grad ■optim ■act" in screen_text(pilot) and "master" not in screen_text(pilot)
        card.update_data(rank_entry(3, master_bytes=4 * MIB), simulated=True)
        await pilot.pause(REPAINT_WAIT_S)
        assert "■param ■grad ■optim ■master ■act" in screen_text(pilot) and "inputs" not in screen_text(pilot)
        # a Hugging Face model's masks and rotary tables, shared by its blocks (docs/models.md)
        card.update_data(rank_entry(3, master_bytes=4 * MIB, inputs_bytes=MIB), simulated=True)
        await pilot.pause(REPAINT_WAIT_S)
        assert "■param ■grad ■optim ■master ■act ■inputs" in screen_text(pilot)

    mounted(DeviceCard(3), test)


# --- a pipeline's stages x replicas (hello's layout.grid) ------------------------------------------

def grid_step(messages: list[dict]) -> dict:
    return [msg for msg in messages if msg.get("type") == "step"][-1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("order", ["stage", "replica"])
def test_a_grids_ranks_are_placed_as_the_engine_places_them(order):
    from engine.strategies.pipeline.grid import Grid
    from widgets.fleet import fleet_rows, places
    grid = Grid.of(16, 64, order)
    assert places(grid.said()) == {rank: (grid.stage_of(rank), grid.replica_of(rank)) for rank in range(64)}
    assert places(Grid.of(4, 4).said()) == {} and places(None) == {} and places({"replicas": 4}) == {}
    rows = fleet_rows([rank_entry(r) for r in range(64)], True, grid=grid.said())
    assert [(row["stage"], row["replica"]) for row in rows] == [places(grid.said())[r] for r in range(64)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("order", ["stage", "replica"])
def test_the_devices_table_groups_64_ranks_by_stage_with_each_replica_under_it(order):
    """16 stages x 4 replicas on 8 hosts: a line per stage naming its ranks and hosts, its 4 replicas under it,
    in the grid's numbers; a slow replica stands out among its stage's replicas alone (the stages differ by
    design: the stages panel shows that), and the others of its stage wait on it."""
    from engine.strategies.pipeline.grid import Grid
    from tests.fleet_feed import pipeline_grid_feed
    from widgets.device_table import FleetTable
    from widgets.fleet import rank_ranges
    messages = pipeline_grid_feed(16, 4, order, slow=(5, 2))
    hello, step, grid = messages[0], grid_step(messages), Grid.of(16, 64, order)
    assert hello["layout"]["grid"] == grid.said()
    slow = grid.rank(5, 2)

    async def test(pilot, panel: DevicesPanel) -> None:
        panel.update_ranks(step["ranks"], True, names=hello.get("devices"), hosts=hello["hosts"],
                           grid=hello["layout"]["grid"])
        await pilot.pause(REPAINT_WAIT_S)
        table = panel.query_one(FleetTable)
        groups = [payload for kind, payload in table.body if kind == "group"]
        assert [(field, stage) for field, stage, _ in groups] == [("stage", s) for s in range(16)]
        assert [[row["rank"] for row in rows] for *_, rows in groups] == [grid.group_of(s) for s in range(16)]
        assert [[row["replica"] for row in rows] for *_, rows in groups] == [list(range(4))] * 16
        lines = [table.body_text(i).plain for i, (kind, _) in enumerate(table.body) if kind == "group"]
        for stage, line in enumerate(lines):
            ranks = grid.group_of(stage)
            hosts = ", ".join(f"h{h}" for h in sorted({r // 8 for r in ranks}))
            assert line.startswith(f"── stage {stage} · ranks {rank_ranges(ranks)} · {hosts}  memory "), line
        assert "replica" in table.keys and table.pinned[0].plain.startswith("job 64 ranks on 8 hosts, 16 stages x 4")
        assert table.found == {slow: ["slow: compute 1.6x median"],
                               **{rank: [f"waiting (on rank {slow})"] for rank in grid.group_of(5) if rank != slow}}
        table.set_filter("s5")   # a stage's replicas alone
        assert table.shown_ranks == grid.group_of(5)
        table.set_filter("")
        table.sort_by("compute")   # the slow replica's stage first, the slow replica at its top
        assert table.shown_ranks[0] == slow and [p[1] for k, p in table.body if k == "group"][0] == 5

    mounted(DevicesPanel(), test, size=(60, 100))


@pytest.mark.timeout(60)
def test_a_pipeline_of_one_replica_is_shown_as_before():
    """The engine says no grid with one replica; a grid of one replica, said or not, changes nothing."""
    from tests.fleet_feed import pipeline_grid_feed
    from widgets.device_table import FleetTable
    messages = pipeline_grid_feed(16, 1)
    hello, step = messages[0], grid_step(messages)
    assert "grid" not in hello["layout"]
    one = {"stages": 16, "replicas": 1, "order": "stage", "ranks": [[s] for s in range(16)]}

    async def test(pilot, panel: DevicesPanel) -> None:
        shown = []
        for grid in (None, one):
            panel.update_ranks(step["ranks"], True, hosts=hello["hosts"], grid=grid)
            await pilot.pause(REPAINT_WAIT_S)
            table = panel.query_one(FleetTable)
            assert not any("stage" in row for row in table.rows) and "replica" not in table.keys
            shown.append(screen_text(pilot))
        assert shown[0] == shown[1] and "── host 1 · 8 ranks" in shown[0] and "stage" not in shown[0]

    mounted(DevicesPanel(), test, size=(60, 40))


@pytest.mark.timeout(60)
def test_a_grids_cards_say_their_stage_and_replica():
    from rich.text import Text
    from engine.strategies.pipeline.grid import Grid

    async def test(pilot, panel: DevicesPanel) -> None:
        panel.update_ranks([rank_entry(r) for r in range(4)], True, grid=Grid.of(2, 4, "replica").said())
        await pilot.pause(REPAINT_WAIT_S)
        titles = {card.rank: Text.from_markup(str(card.border_title)).plain for card in panel.query(DeviceCard)}
        assert titles[1] == "stage 1 · replica 0 rank 1 simulated" and titles[2].startswith("stage 0 · replica 1 ")
        assert panel.card_data(3)[2] == {"label": "stage 1 · replica 1"}
        panel.update_ranks([rank_entry(r) for r in range(4)], True)   # no grid: as before
        await pilot.pause(REPAINT_WAIT_S)
        assert Text.from_markup(str(panel.query(DeviceCard).first().border_title)).plain == "rank 0 simulated"

    mounted(DevicesPanel(), test)


@pytest.mark.timeout(60)
def test_the_layer_table_names_each_layers_stage_and_its_replicas():
    from tests.fleet_feed import pipeline_grid_feed
    messages = pipeline_grid_feed(16, 4)
    rows = next(msg["layers"] for msg in reversed(messages) if msg.get("layers"))

    async def test(pilot, table: LayerTable) -> None:
        table.update_layers(rows, grid=messages[0]["layout"]["grid"])
        await pilot.pause(REPAINT_WAIT_S)
        assert [table.get_cell(name, "where").plain for name in ("embed", "blocks.9", "head")] == \
            ["stage 0 ×4", "stage 5 ×4", "stage 15 ×4"]
        table.update_layers(rows)   # one replica: the stage alone
        await pilot.pause(REPAINT_WAIT_S)
        assert table.get_cell("blocks.9", "where").plain == "stage 5"

    mounted(LayerTable(), test)

