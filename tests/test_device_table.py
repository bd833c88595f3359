"""The Devices table at the size of real jobs: the pure rules first (widgets/fleet.py: outliers, sort,
filter, summaries), then the panel alone, then the console at 64 ranks on 8 hosts (Pilot and snapshots).

Run: `python -m pytest tests/test_device_table.py -q`. Refresh this file's pictures after a deliberate
change with `--snapshot-update` on this file only, and look at them.
"""

from __future__ import annotations

import asyncio

import pytest

from console.app import ConsoleApp
from console.client import ReplaySource
from console.screens import DeviceCardScreen
from tests.fleet_feed import ddp_feed_8, gpu_feed_64, write_feed
from tests.test_console_snapshots import settle, utc  # noqa: F401 (utc: autouse, the records' times)
from tests.test_widgets import mounted, screen_text
from widgets.device_table import FleetTable
from widgets.devices import DeviceCard, DevicesPanel
from widgets.fleet import (compute_of, filter_rows, fleet_rows, group_rows, memory_fraction, outlier_groups,
                           outliers, rank_ranges, short_gpu_name, sort_rows, summarize)

MIB, GIB = 2**20, 2**30


def rank_row(rank: int, host: int = 0, compute: float = 10.0, wait: float = 0.5, step: float = 12.0,
             used: int = 20 * MIB, capacity: int = 64 * MIB, **extra) -> dict:
    return {"rank": rank, "host": host, "fwd_ms": compute / 3, "bwd_ms": compute * 2 / 3, "optim_ms": 1.0,
            "step_ms": step, "wait_ms": wait, "used_bytes": used, "peak_bytes": used, "capacity_bytes": capacity,
            "over_capacity": False, "rss_bytes": 400 * MIB, **extra}


def synchronous_job(slow: int | None = 5, ranks: int = 8, factor: float = 1.6) -> list[dict]:
    """Every rank's wall step is the slow one's: the others wait at the boundary for the difference."""
    rows = [rank_row(r, host=r // 4, compute=10.0 * (factor if r == slow else 1.0)) for r in range(ranks)]
    for row in rows:
        row["wait_ms"] = max(compute_of(r) for r in rows) - compute_of(row) + 0.2
    return rows


# --- the rules ---------------------------------------------------------------------

def test_short_gpu_names():
    assert short_gpu_name("NVIDIA H100 80GB HBM3") == "H100 80GB"
    assert short_gpu_name("NVIDIA A100-SXM4-80GB") == "A100 80GB"
    assert short_gpu_name("NVIDIA GeForce RTX 4090") == "RTX 4090"
    assert short_gpu_name("cpu (simulated device: memory from the engine's ledger)") == "cpu"
    assert short_gpu_name(None) == ""


def test_a_straggler_is_found_by_its_compute_and_its_peers_wait_on_it():
    found = outliers(synchronous_job(slow=5))
    assert found[5] == ["slow: compute 1.6x median"]
    assert all(found[r] == ["waiting (on rank 5)"] for r in range(8) if r != 5)
    # the wall step is the same everywhere: by step time alone nobody would stand out
    assert not any("step" in reason for reasons in found.values() for reason in reasons)
    groups = outlier_groups(found)
    assert groups[0] == ([5], ["slow: compute 1.6x median"])
    assert groups[1] == ([0, 1, 2, 3, 4, 6, 7], ["waiting (on rank 5)"])
    assert rank_ranges(groups[1][0]) == "0-4, 6-7"


def test_a_steady_job_has_no_outliers_and_the_floor_keeps_noise_out():
    assert outliers(synchronous_job(slow=None)) == {}
    # 0.2 ms against a median of 0.1 ms is twice the median, and noise: under the 1 ms floor
    rows = [rank_row(r, wait=0.2 if r == 3 else 0.1, compute=0.5 if r == 3 else 0.3, step=0.6) for r in range(8)]
    assert outliers(rows) == {}
    # above the floor, a wait or a step stands out on its own
    rows = [rank_row(r, wait=6.0 if r == 3 else 0.1, step=20.0 if r == 6 else 12.0) for r in range(8)]
    assert outliers(rows) == {3: ["wait 60.0x median"], 6: ["step 1.7x median"]}


def test_compute_ms_is_preferred_to_forward_plus_backward():
    rows = [rank_row(r) for r in range(6)]
    rows[2]["compute_ms"] = 30.0          # the device's clock says so, whatever fwd + bwd say
    assert compute_of(rows[2]) == 30.0 and compute_of(rows[1]) == pytest.approx(10.0)
    assert outliers(rows)[2] == ["slow: compute 3.0x median"]


def test_memory_above_ninety_percent_nvml_first_and_over_capacity():
    rows = [rank_row(r) for r in range(6)]
    rows[0].update(used_bytes=59 * MIB)                                          # 92% of the ledger's
    rows[1].update(used_bytes=int(57.6 * MIB))                                   # 90%: not above
    rows[2].update(nvml_used_bytes=78 * GIB, nvml_total_bytes=80 * GIB)          # NVML's 98%, the ledger's 31%
    rows[3].update(over_capacity=True, peak_bytes=70 * MIB)
    rows[4].update(peak_bytes=60 * MIB)                                          # the ledger's peak at 94%
    found = outliers(rows)
    assert found[0] == ["memory 92%"] and 1 not in found and found[2] == ["memory 98%"]
    assert found[3] == ["over capacity"] and found[4] == ["peak 94%"]
    assert memory_fraction(rows[2]) == pytest.approx(78 / 80)


def test_stale_rows_and_lost_workers_are_flagged_and_left_out_of_the_medians():
    rows = synchronous_job(slow=None)
    rows[6].update(stale_steps=3, fwd_ms=100.0)   # old figures: a stale rank is not a straggler
    rows[7].update(stale_steps=1)
    found = outliers(rows)
    assert found == {6: ["stale: 3 steps old"], 7: ["stale: 1 step old"]}
    ranks = [rank_row(r, role="server" if r < 2 else "worker") for r in range(8)]
    ps = {"workers": [{"rank": r, "alive": r != 7} for r in range(2, 8)], "workers_lost": [7]}
    rows = fleet_rows(ranks[:7], True, ps=ps)   # the lost worker sends no row any more
    assert [row["label"] for row in rows][:3] == ["server 0", "server 1", "worker 0"] and rows[7]["lost"]
    assert outliers(rows) == {7: ["lost"]}


def test_parameter_server_workers_are_judged_on_their_own():
    ranks = [rank_row(r, role="server" if r < 2 else "worker", step=30.0 if r == 7 else 12.0) for r in range(8)]
    rows = fleet_rows(ranks, True, ps={"workers": [{"rank": r} for r in range(2, 8)]})
    # asynchronous: a slow worker's step stands out; nobody waits on it, and the servers are their own peers
    assert outliers(rows) == {7: ["step 2.5x median"]}


def test_fleet_rows_hosts_names_and_devices():
    gpu = rank_row(0, nvml_used_bytes=GIB, nvml_total_bytes=80 * GIB, gpu_util_percent=97.0)
    rows = fleet_rows([gpu, rank_row(1)], False, names=["NVIDIA H100 80GB HBM3"] * 2, hosts=[0, 3])
    assert [(row["host"], row["device"]) for row in rows] == [(0, "H100 80GB"), (3, "cpu")]
    rows = fleet_rows([rank_row(0), rank_row(1)], True)   # no hosts: every rank on host 0
    assert [(row["host"], row["device"]) for row in rows] == [(0, "simulated"), (0, "simulated")]


def test_sort_group_and_filter():
    rows = synchronous_job(slow=5)
    rows[2]["used_bytes"] = 60 * MIB
    assert [r["rank"] for r in sort_rows(rows, "memory")][:2] == [2, 0]
    assert [r["rank"] for r in sort_rows(rows, "compute")][0] == 5
    assert [r["rank"] for r in sort_rows(rows, "wait")][-1] == 5   # the slow rank waits least
    assert [r["rank"] for r in sort_rows(rows, "rank")] == list(range(8))
    with pytest.raises(ValueError):
        sort_rows(rows, "colour")
    # grouped by host: the host of the job's top row first, its rows in order
    assert [(host, [r["rank"] for r in group]) for host, group in group_rows(rows, "compute")][0][1][0] == 5
    assert [host for host, _ in group_rows(rows, "memory")] == [0, 1]
    assert [host for host, _ in group_rows(rows, "compute")] == [1, 0]
    assert [host for host, _ in group_rows(rows, "rank")] == [0, 1]
    ranks = lambda text: [r["rank"] for r in filter_rows(rows, text)]   # noqa: E731
    assert ranks("h1") == ranks("host 1") == [4, 5, 6, 7]
    assert ranks("5") == ranks("rank 5") == [5]
    assert ranks("h0, 7") == [0, 1, 2, 3, 7]
    assert ranks("") == list(range(8)) and ranks("h9") == []


def test_summaries_are_min_median_max():
    rows = [rank_row(r, host=r // 2, step=s, used=u * MIB, capacity=100 * MIB)
            for r, (s, u) in enumerate([(10.0, 10), (11.0, 20), (14.0, 30), (12.0, 90)])]
    summary = summarize(rows)
    assert summary["ranks"] == 4 and summary["hosts"] == 2
    assert summary["step_ms"] == (10.0, 11.5, 14.0)
    assert summary["memory_percent"] == pytest.approx((10.0, 25.0, 90.0))
    assert summary["compute_ms"] == pytest.approx((10.0, 10.0, 10.0))
    assert summarize([])["step_ms"] is None


# --- the panel alone ---------------------------------------------------------------

@pytest.mark.timeout(60)
def test_the_panel_shows_cards_up_to_max_cards_and_the_table_above():
    async def test(pilot, panel: DevicesPanel) -> None:
        panel.repaint.interval_s = 0.0
        panel.update_ranks(synchronous_job(slow=None, ranks=DevicesPanel.MAX_CARDS), simulated=True)
        await pilot.pause()
        assert len(panel.query(DeviceCard)) == DevicesPanel.MAX_CARDS and not panel.tabular
        assert not panel.border_subtitle
        panel.update_ranks(synchronous_job(slow=5), simulated=True, hosts=[0, 0, 0, 0, 1, 1, 1, 1])
        await pilot.pause()
        table = panel.query_one(FleetTable)
        assert panel.tabular and table.display and not panel.query(DeviceCard)
        assert table.shown_ranks == list(range(8)) and panel.border_subtitle == "sort rank"
        text = screen_text(pilot)
        assert "rank 5 (h1)  slow: compute 1.6x median" in text and "7 ranks  waiting (on rank 5): 0-4, 6-7" in text
        assert "host 1 · 4 ranks" in text and "job 8 ranks on 2 hosts" in text
        panel.update_ranks(synchronous_job(slow=None, ranks=2), simulated=True)   # back to cards
        await pilot.pause()
        assert len(panel.query(DeviceCard)) == 2 and not table.display and not panel.border_subtitle

    mounted(DevicesPanel(), test, size=(160, 40))


@pytest.mark.timeout(60)
def test_a_parameter_server_table_names_roles_and_a_lost_worker():
    ranks = [rank_row(r, role="server" if r < 2 else "worker") for r in range(8)]
    ps = {"workers": [{"rank": r, "alive": r != 7} for r in range(2, 8)], "workers_lost": [7]}

    async def test(pilot, panel: DevicesPanel) -> None:
        panel.update_ranks(ranks[:7], simulated=True, ps=ps)
        await pilot.pause()
        text = screen_text(pilot)
        assert "worker 5 (rank 7, h0)  lost" in text and "role" in text and "server 1" in text

    mounted(DevicesPanel(), test, size=(160, 40))


# --- the console at 64 ranks -------------------------------------------------------



def replay(messages: list[dict], tmp_path) -> ReplaySource:
    """Paused one message short of the end: at the end the events panel would say so, stamped with the clock."""
    return ReplaySource(write_feed(messages, tmp_path / "feed.jsonl"), paused=True, preload=len(messages) - 1)


@pytest.mark.timeout(120)
def test_console_at_64_ranks_cards_sort_filter_and_pinned_outliers(tmp_path):
    async def scenario():
        app = ConsoleApp(replay(gpu_feed_64(), tmp_path))
        async with app.run_test(size=(200, 60)) as pilot:
            await settle(pilot)
            table, panel = app.query_one(FleetTable), app.query_one(DevicesPanel)
            assert len(table.shown_ranks) == 64 and table.found[41] == ["memory 98%", "slow: compute 1.6x median"]
            table.focus()
            await pilot.press("down", "down", "enter")     # rank 2's full card, in a dialog
            assert isinstance(app.screen, DeviceCardScreen)
            card = app.screen.query_one(DeviceCard)
            assert card.rank == 2 and "unexplained" in str(card.render()) and "H100 80GB HBM3" in str(card.render())
            await pilot.press("escape")
            assert not isinstance(app.screen, DeviceCardScreen)
            await pilot.press("o")                          # sort by memory: the 98% rank first
            assert table.sort_key == "memory" and table.shown_ranks[0] == 41 and table.cursor_rank == 41
            assert panel.border_subtitle == "sort memory"
            await pilot.press("slash", *"h3", "enter")      # host 3's ranks only
            assert table.shown_ranks == sorted(range(24, 32), key=lambda r: -memory_fraction(
                next(row for row in table.rows if row["rank"] == r)))
            assert panel.border_subtitle == "sort memory · filter 'h3'" and table.has_focus
            table.set_filter("")
            await pilot.press("end")                        # scrolled to the bottom: the outliers stay on top
            await pilot.pause(0.1)
            assert table.scroll_offset.y == table.max_scroll_y > 0
            text = screen_text(pilot)
            assert "rank 41 (h5)  memory 98%  ·  slow: compute 1.6x median" in text
            assert "63 ranks  waiting (on rank 41): 0-40, 42-63" in text
            await pilot.press("question_mark")              # help says what the table's keys do
            assert any("devices table" in description for _, description in app.screen.keys)
    asyncio.run(scenario())


async def focused_settle(pilot) -> None:
    await settle(pilot)
    pilot.app.query_one(FleetTable).focus()
    await pilot.pause(0.1)


@pytest.mark.timeout(120)
def test_devices_table_8_ranks(snap_compare, tmp_path):
    # simulated CPU devices on 2 hosts: rank 5 is slow and 95% full, the others wait on it
    app = ConsoleApp(replay(ddp_feed_8(), tmp_path))
    assert snap_compare(app, terminal_size=(160, 48), run_before=focused_settle)


@pytest.mark.timeout(120)
def test_devices_table_64_ranks_on_8_hosts(snap_compare, tmp_path):
    # H100s: rank 41 (host 5) at 98% of its memory and 1.6x slow, pinned above the rows
    app = ConsoleApp(replay(gpu_feed_64(), tmp_path))
    assert snap_compare(app, terminal_size=(200, 60), run_before=settle)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("strategy", ["ddp", "sharded"])
def test_a_real_straggler_is_flagged_by_its_compute_and_its_peers_as_waiting(cli, strategy):
    """Four CPU workers, rank 2 made slow by `[emulate] slow_rank` (150 ms a step: far more than a busy
    host adds to a peer's compute; at 60 ms a peer was flagged once beside another test): every rank's
    wall step is the same, yet the log's rows (compact columns between full rows, filled in) single out
    rank 2's compute, and its peers wait for it (ddp inside backward, sharded in the reduce)."""
    from tests.conftest import ROOT, read_jsonl
    log = cli.tmp_path / "straggler.jsonl"
    r = cli.run("run", str(ROOT / "demo" / "configs" / "digits_ddp.toml"), "--headless", "--steps", "8",
                *cli.base_args(f"straggler-{strategy}"), "--set", f"parallel.strategy={strategy}",
                "--set", "parallel.world_size=4", "--set", "emulate.slow_rank=2", "--set", "emulate.slow_rank_ms=150",
                "--set", "telemetry.rank_every=3", "--set", "run.eval_every=0", "--telemetry-log", str(log),
                timeout=140)
    assert r.returncode == 0, r.stderr
    steps = [rec for rec in read_jsonl(log) if rec["type"] == "step" and rec["step"] >= 2]
    assert len(steps) == 7
    for rec in steps:
        found = outliers(fleet_rows(rec["ranks"], simulated=True))
        assert found.get(2) == ["slow: compute " + found[2][0].split("compute ")[1]] and "slow" in found[2][0], \
            (rec["step"], found, [(e["rank"], e["compute_ms"], e["step_ms"], e["wait_ms"]) for e in rec["ranks"]])
        assert all(found.get(peer) == ["waiting (on rank 2)"] for peer in (0, 1, 3)), (rec["step"], found)
