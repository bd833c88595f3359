"""The console against a hub: keys send the right commands, replies show, the link heals, and
the keys a run does not take are dimmed.

Most tests serve a recorded feed from an in-process engine.telemetry.hub.Hub, with a thread that answers
commands as the engine would (FakeEngine); the last one attaches to a real headless run.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import pytest
from textual.actions import parse as parse_action
from textual.widgets import Footer, OptionList

from console.app import ConsoleApp
from console.client import ReplaySource, SocketSource, replay_messages
from console.screens import HelpScreen, QuitScreen, RunPicker, SyncScreen
from console.state import RunState, headline, keys_line
from engine.telemetry.hub import Hub
from engine import protocol
from engine.protocol import COMMANDS
from tests.conftest import read_jsonl
from widgets.events import EventLog
from widgets.layers import LayerTable
from widgets.stages import StagesPanel

FIXTURES = Path(__file__).parent / "fixtures"
DDP_FEED, PIPELINE_FEED = FIXTURES / "ddp_feed.jsonl", FIXTURES / "pipeline_feed.jsonl"
PS_FEED = FIXTURES / "ps_run.jsonl"   # param_server: 2 servers, 4 workers (rank 5 slow, then lost)
SIZE = (120, 40)
# what each mode's hello offers (engine: the strategies' `commands`, and set-policy)
CAPABILITIES = {"ddp": ("pause", "resume", "stop", "checkpoint", "set-policy", "set-placement"),
                "pipeline": ("pause", "resume", "stop", "checkpoint", "set-placement", "rebalance", "set-policy"),
                "param_server": ("pause", "resume", "stop", "checkpoint", "set-sync")}
WORLD = {"ddp": 2, "pipeline": 3, "param_server": 6}
COMMAND_KEYS = "pxrkscum"


class FakeEngine:
    """A hub serving a feed's records, and a thread that applies or rejects commands."""

    def __init__(self, name: str, feed: Path, capabilities=tuple(COMMANDS), reject: dict | None = None,
                 refuse: dict | None = None, records: int | None = None):
        messages = replay_messages(read_jsonl(feed))[:records]
        hello = {k: v for k, v in messages[0].items() if k not in ("v", "type", "protocol", "started")}
        self.hub = Hub({**hello, "run": name, "capabilities": list(capabilities)},
                       validate=lambda cmd, args: (refuse or {}).get(cmd))
        self.reject, self.commands, self.step = reject or {}, [], 0
        self.hub.start()
        layers = None
        for msg in messages[1:]:
            self.hub.publish(dict(msg))
            self.step = msg.get("step", self.step)
            layers = msg.get("layers", layers)
        self.hub.update_state(step=self.step, steps=hello.get("steps"), paused=False,
                              **({"layers": layers} if layers else {}))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._answer, daemon=True)
        self._thread.start()

    def _answer(self) -> None:
        while not self._stop.wait(0.01):
            for command in self.hub.take_commands():
                self.commands.append((command["name"], command["args"]))
                if command["name"] in self.reject:
                    self.hub.reply(command, "rejected", reason=self.reject[command["name"]])
                else:
                    self.hub.reply(command, "applied", step=self.step)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.hub.close("run finished")


@pytest.fixture
def engines(runtime_dir):
    started = []

    def start(*args, **kwargs) -> FakeEngine:
        started.append(FakeEngine(*args, **kwargs))
        return started[-1]
    yield start
    for engine in started:
        engine.close()


def run(coro):
    return asyncio.run(coro)


async def until(pilot, predicate, timeout: float = 10.0, what: str = "a condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        await pilot.pause(0.05)


def events_text(app: ConsoleApp) -> str:
    return "\n".join(line.text for line in app.query_one(EventLog).lines)


async def attached(pilot, app: ConsoleApp) -> None:
    await until(pilot, lambda: app.link_state == "connected" and app.state.last_step, what="the console to attach")
    app.refresh_panels(force=True)   # the panels hold the snapshot now, not at their next turn
    await pilot.pause(0.1)


def footer_keys(app: ConsoleApp) -> dict[str, bool]:
    """The footer's keys: key -> lit (False: dimmed)."""
    return {key.key: not key.has_class("-disabled") for key in app.query_one(Footer).query("FooterKey")}


def key_states(app: ConsoleApp) -> dict[str, bool | None]:
    """check_action for each key: True lit, None dimmed, False hidden."""
    return {b.key: app.check_action(*parse_action(b.action)[1:]) for b in app.BINDINGS}


def offline(mode: str, *, read_only: bool = False, link: str = "connected",
            capabilities: tuple | None = None) -> ConsoleApp:
    """A console that has had `mode`'s hello, not running: enough to ask which keys it offers."""
    app = ConsoleApp(SocketSource(mode, read_only=read_only))
    app.link_state = link
    app.state.apply({"type": "hello", "run": mode, "mode": mode, "world_size": WORLD[mode],
                     "capabilities": list(CAPABILITIES[mode] if capabilities is None else capabilities)})
    return app


async def select(pilot, app: ConsoleApp, layer: str) -> None:
    table = app.query_one(LayerTable)
    # the table repaints at most 4 times a second: wait for the row to be there
    await until(pilot, lambda: layer in table.shown, what=f"layer {layer} in the table")
    table.move_cursor(row=table.shown.index(layer))


@pytest.mark.timeout(60)
def test_each_key_sends_its_command_and_the_reply_shows(engines):
    engine = engines("pipe", PIPELINE_FEED)

    async def scenario():
        app = ConsoleApp(SocketSource("pipe"))
        async with app.run_test(size=SIZE) as pilot:
            await attached(pilot, app)
            titles = " ".join(c.title for c in app.get_system_commands(app.screen))
            for title in ("Pause (p)", "Rebalance (r)", "Keep (k)", "Swap (s)", "Recompute (c)", "Placement (u)",
                          "Checkpoint (x)", "Filter (/)", "Quit (q)"):
                assert title in titles
            await select(pilot, app, "blocks.3")
            for key in "skcu":
                await pilot.press(key)
            await select(pilot, app, "head")           # its update runs on the host: u moves it back
            await pilot.press("u")
            for key in "rxp":
                await pilot.press(key)
            await until(pilot, lambda: "pause: applied" in events_text(app), what="the pause reply")
            await pilot.press("p")        # paused now: p resumes
            await until(pilot, lambda: "resume: applied" in events_text(app), what="the resume reply")
            text = events_text(app)
            print(text)
        assert engine.commands == [
            ("set-policy", ["blocks.3", "swap"]), ("set-policy", ["blocks.3", "keep"]),
            ("set-policy", ["blocks.3", "recompute"]), ("set-placement", ["blocks.3", "host"]),
            ("set-placement", ["head", "device"]), ("rebalance", []), ("checkpoint", []), ("pause", []),
            ("resume", [])]
        assert "set-policy blocks.3 swap: pending" in text
        assert f"set-policy blocks.3 swap: applied at step {engine.step}" in text
        assert f"checkpoint: applied at step {engine.step}" in text
    run(scenario())


@pytest.mark.timeout(60)
def test_m_chooses_the_sync_mode_and_sends_set_sync(engines):
    engine = engines("ps", PS_FEED, capabilities=("pause", "resume", "stop", "checkpoint", "set-sync"))

    async def scenario():
        app = ConsoleApp(SocketSource("ps"))
        async with app.run_test(size=SIZE) as pilot:
            await attached(pilot, app)
            assert app.check_action("sync", ()) and app.state.sync_mode == "soft"
            assert "sync soft" in str(app.query_one("#status").render())
            await pilot.press("m")
            assert isinstance(app.screen, SyncScreen)
            options = app.screen.query_one(OptionList)
            assert options.highlighted == 0 and "(current)" in str(options.get_option_at_index(0).prompt)
            await pilot.press("down", "enter")           # soft -> bsp
            await until(pilot, lambda: "set-sync bsp: applied" in events_text(app), what="the set-sync reply")
            await pilot.press("m", "escape")              # changed its mind: nothing sent
            await pilot.pause(0.1)
            text = events_text(app)
            print(text)
        assert engine.commands == [("set-sync", ["bsp"])]
        assert "set-sync bsp: pending" in text and f"set-sync bsp: applied at step {engine.step}" in text
    run(scenario())


def test_every_evaluations_validation_loss_reaches_the_curves_beside_the_training_loss():
    from widgets.curves import Curves
    state = RunState()
    state.apply({"type": "hello", "run": "lm", "mode": "ddp", "world_size": 2, "layout": {"strategy": "ddp"}})
    for step, val in ((100, 2.5), (200, 2.1)):
        state.apply({"type": "event", "kind": "eval", "step": step, "time": float(step), "test_accuracy": None,
                     "val_loss": val, "perplexity": 2.718281828 ** val})
    state.apply({"type": "event", "kind": "eval", "step": 300, "time": 300.0, "test_accuracy": 0.5,
                 "val_loss": None, "perplexity": None})   # a run without a validation loss: no point
    assert state.val_losses == [(100, 2.5), (200, 2.1)]
    # a restart from step 150's checkpoint replays its evaluations: the later one goes
    state.apply({"type": "event", "kind": "eval", "step": 150, "time": 400.0, "test_accuracy": None,
                 "val_loss": 2.3, "perplexity": 9.97})
    assert state.val_losses == [(100, 2.5), (150, 2.3)]
    curves = Curves()
    curves.set_validation(state.val_losses)
    assert curves.val_losses == [(100, 2.5), (150, 2.3)] and curves.dirty
    curves.clear()
    assert curves.val_losses == []


def test_the_sync_mode_follows_hello_events_and_steps():
    hello = {"type": "hello", "run": "ps", "mode": "param_server", "world_size": 6,
             "layout": {"strategy": "param_server", "sync": "soft"}}
    state = RunState()
    state.apply(hello)
    assert "sync soft" in headline(state, wide=True, live=False).plain
    state.apply({"type": "event", "kind": "sync_mode", "step": 12, "mode": "bsp", "previous": "soft",
                 "source": "command"})
    assert state.sync_mode == "bsp"
    state.apply({"type": "step", "step": 14, "loss": 1.0, "ps": {"mode": "asp", "layers": []}})
    assert state.sync_mode == "asp" and state.ps == {"mode": "asp", "layers": []}
    # a reconnect: the hello holds the configured mode, the snapshot repeats an older event
    state.apply(hello)
    state.apply({"type": "snapshot", "step": 15, "last_step": {"step": 15, "loss": 1.0, "ps": {"mode": "asp"}},
                 "events": [{"type": "event", "kind": "sync_mode", "step": 13, "mode": "ssp", "time": 1.0}]})
    assert state.sync_mode == "asp"
    assert "sync" not in headline(RunState(), wide=True, live=False).plain   # other modes say nothing
    other = RunState()   # the header asks whether a sync mode is known, not which strategy runs
    other.apply({**hello, "run": "other", "mode": "elastic", "layout": {"sync": "ssp"}})
    assert "sync ssp" in headline(other, wide=True, live=False).plain


def test_a_gpu_runs_devices_and_device_note_reach_the_state_once_a_run():
    hello, *rest = replay_messages(read_jsonl(FIXTURES / "gpu_feed.jsonl"))
    assert hello["type"] == "hello" and hello["simulated"] is False
    assert hello["devices"] == ["NVIDIA H100 80GB HBM3"] * 2
    assert hello["device_note"].startswith("cuda: one GPU per worker")
    old = replay_messages(read_jsonl(DDP_FEED))[0]   # a log from before: neither key, not empty ones
    assert "devices" not in old and "device_note" not in old
    state = RunState()
    state.apply(hello)
    assert state.device_names == hello["devices"]
    assert state.take()[2] == [(f"device {hello['device_note']}", "cyan", hello["started"])]
    state.apply(hello)   # a reconnect says nothing again
    assert state.take()[2] == []
    state.apply(old)
    assert state.device_names is None and state.take()[2] == []


@pytest.mark.timeout(60)
def test_rejected_commands_show_their_reason(engines):
    engine = engines("picky", PIPELINE_FEED, refuse={"rebalance": "a rebalance is already in flight"},
                     reject={"checkpoint": "the disk is full"})

    async def scenario():
        app = ConsoleApp(SocketSource("picky"))
        async with app.run_test(size=SIZE) as pilot:
            await attached(pilot, app)
            await pilot.press("r", "x")
            await until(pilot, lambda: "checkpoint: rejected" in events_text(app), what="the rejection")
            await until(pilot, lambda: "rebalance: rejected" in events_text(app), what="the refusal")
            text = events_text(app)
            print(text)
        assert "rebalance: rejected: a rebalance is already in flight" in text
        assert "checkpoint: rejected: the disk is full" in text
        assert engine.commands == [("checkpoint", [])]   # the refused one never reached the engine
    run(scenario())


def test_a_key_is_lit_only_where_the_run_takes_its_command():
    ddp, pipeline, ps = offline("ddp"), offline("pipeline"), offline("param_server")
    assert ddp.check_action("command", ("rebalance",)) is None            # dimmed: shown, does nothing
    assert pipeline.check_action("command", ("rebalance",)) is True
    assert ddp.check_action("sync", ()) is None and ps.check_action("sync", ()) is True
    assert {key for key, lit in key_states(ddp).items() if lit is None} == {"r", "m"}
    assert {key for key, lit in key_states(ddp).items() if lit is False} == {"space", "n", "plus", "minus"}
    assert {key for key, lit in key_states(pipeline).items() if lit is None} == {"m"}
    assert {key for key, lit in key_states(ps).items() if lit is None} == set("rkscu")
    no_rebalance = offline("pipeline", capabilities=("pause", "resume", "stop", "checkpoint", "set-placement",
                                                     "set-policy"))
    assert no_rebalance.check_action("command", ("rebalance",)) is None   # parallel.pipeline.rebalance = "off"


def test_every_command_key_is_dimmed_when_this_console_cannot_send():
    read_only = key_states(offline("pipeline", read_only=True))
    lost, connecting = key_states(offline("pipeline", link="lost")), key_states(ConsoleApp(SocketSource("x")))
    for states in (read_only, lost, connecting):
        assert all(states[key] is None for key in COMMAND_KEYS)
        assert states["slash"] and states["question_mark"] and states["q"] and states["space"] is False
    replay = key_states(ConsoleApp(ReplaySource(DDP_FEED)))   # a replay takes no command: its keys are hidden
    assert all(replay[key] is False for key in COMMAND_KEYS)
    assert all(replay[key] for key in ("space", "n", "plus", "minus", "slash", "q"))


def test_the_keys_line_says_which_keys_do_something_in_this_run():
    def line(mode, read_only=False, replay=False):
        return keys_line(offline(mode, capabilities=() if replay else None).state, read_only, replay).plain
    assert line("ddp") == \
        "ddp: k/s/c activations keep/swap/recompute · u update device/host · p pause · x checkpoint · q quit"
    assert line("pipeline") == ("pipeline: r rebalance · k/s/c activations keep/swap/recompute · "
                                "u update device/host · p pause · x checkpoint · q quit")
    assert len(line("pipeline")) <= 118   # one line on a wide screen, inside its padding
    assert line("param_server") == "param_server: m sync mode soft/bsp/asp/ssp · p pause · x checkpoint · q quit"
    assert line("ddp", read_only=True) == "ddp: watch only · q quit"
    assert line("ddp", replay=True) == "replay of ddp: space play/pause · n step · +/- speed · q quit"
    assert keys_line(RunState(), False, False).plain == "no run yet · q quit"


@pytest.mark.timeout(60)
def test_dimmed_keys_send_nothing_and_say_nothing(engines):
    engine = engines("ddp", DDP_FEED, capabilities=CAPABILITIES["ddp"])
    engines("empty", DDP_FEED, records=1)   # hello only: no layers yet

    async def scenario():
        app = ConsoleApp(SocketSource("ddp", read_only=True))
        async with app.run_test(size=SIZE) as pilot:
            await attached(pilot, app)
            assert "ddp: watch only · q quit" in str(app.query_one("#keys").render())
            await until(pilot, lambda: footer_keys(app).get("p") is False, what="the footer to dim p")
            assert not any(lit for key, lit in footer_keys(app).items() if key in COMMAND_KEYS)
            await pilot.press("p", "x", "s", "r", "m")
            await pilot.pause(0.5)
            assert "commands are disabled" not in events_text(app) and not app.actions.pending
            assert "read-only" in str(app.query_one("#link").render())
        app = ConsoleApp(SocketSource("ddp"))
        async with app.run_test(size=SIZE) as pilot:
            await attached(pilot, app)
            await until(pilot, lambda: footer_keys(app).get("p") is True, what="the footer to light p")
            footer = footer_keys(app)
            assert footer["r"] is False and footer["m"] is False and footer["k"] and footer["u"]
            await pilot.press("r", "m")
            await pilot.pause(0.3)
            assert not isinstance(app.screen, SyncScreen) and "rebalance" not in events_text(app)
        app = ConsoleApp(SocketSource("empty"))
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.link_state == "connected", what="the console to attach")
            await pilot.press("c")
            assert "set-policy recompute: no layer selected" in events_text(app)
        assert engine.commands == []
    run(scenario())


@pytest.mark.timeout(60)
def test_banner_when_the_hub_goes_and_gone_when_it_returns(engines):
    engine = engines("flaky", DDP_FEED)

    async def scenario():
        app = ConsoleApp(SocketSource("flaky"))
        async with app.run_test(size=SIZE) as pilot:
            await attached(pilot, app)
            assert app.banner == ""
            engine.close()
            await until(pilot, lambda: "reconnecting" in app.banner, what="the banner")
            assert app.query_one("#banner").display
            engines("flaky", PIPELINE_FEED)   # a new hub, same run name
            await until(pilot, lambda: app.link_state == "connected", timeout=15, what="the reconnection")
            assert app.banner == "" and not app.query_one("#banner").display
            await until(pilot, lambda: app.state.mode == "pipeline", what="state from the new hello")
    run(scenario())


@pytest.mark.timeout(60)
def test_quit_detach_sends_nothing_and_stop_asks_once(engines):
    engine = engines("leave", DDP_FEED)

    async def scenario():
        app = ConsoleApp(SocketSource("leave"))
        async with app.run_test(size=SIZE) as pilot:
            await attached(pilot, app)
            await pilot.press("q")
            assert isinstance(app.screen, QuitScreen)
            await pilot.press("d")
            await pilot.pause(0.2)
        assert app.return_value == "detach" and engine.commands == []

        app = ConsoleApp(SocketSource("leave"))
        async with app.run_test(size=SIZE) as pilot:
            await attached(pilot, app)
            await pilot.press("q", "escape")        # second thoughts: nothing sent
            assert not isinstance(app.screen, QuitScreen)
            await pilot.press("q")
            assert "final checkpoint" in str(app.screen.query_one("#quit-stop").render())
            await pilot.press("s")                  # final: no second question
            assert app.screen is app.screen_stack[0]
            await until(pilot, lambda: app.return_value is not None, what="the stop reply")
        assert app.return_value == "stop" and engine.commands == [("stop", [])]
    run(scenario())


@pytest.mark.timeout(60)
def test_with_no_run_named_a_picker_lists_the_live_runs(engines):
    engines("alpha", DDP_FEED)
    engines("beta", PIPELINE_FEED)

    async def scenario():
        app = ConsoleApp(None)
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: isinstance(app.screen, RunPicker) and len(app.screen.runs) == 2,
                        what="the picker to list both runs")
            app.screen.query_one(OptionList).highlighted = 1
            await pilot.press("enter")
            await attached(pilot, app)
            assert app.state.hello["run"] == "beta" and app.state.mode == "pipeline"
    run(scenario())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["pipeline", "param_server"])
def test_help_and_quit_stay_on_an_80_column_footer(mode):
    async def scenario():
        app = offline(mode)   # every command key of the mode on show
        async with app.run_test(size=(80, 24)) as pilot:
            footer = app.query_one(Footer)

            def laid_out() -> dict:   # the footer recomposes its keys when the bindings change: read them laid out
                keys = {key.key: key.region for key in footer.query("FooterKey")}
                return keys if {"question_mark", "q", "p"} <= set(keys) and all(r.width for r in keys.values()) else {}
            await until(pilot, laid_out, what="the footer's keys, laid out")
            await pilot.pause(0.1)
            await until(pilot, laid_out, what="the footer's keys, laid out")
            keys = laid_out()
            for key in ("question_mark", "q"):
                assert key in keys and keys[key].right <= 80, (key, keys)
            assert keys["p"].right <= 80   # and the first command keys after them
    run(scenario())


@pytest.mark.timeout(60)
def test_help_lists_every_key_and_the_palette_every_working_one():
    async def scenario():
        app = ConsoleApp(ReplaySource(DDP_FEED, paused=True, preload=10))
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("question_mark")
            assert isinstance(app.screen, HelpScreen)
            keys = [key for key, _ in app.screen.keys]
            for key in ("r", "k", "s", "c", "u", "m", "p", "x", "/", "?", "q", "space", "n", "+", "-"):
                assert key in keys
            await pilot.press("escape")
            titles = " ".join(c.title for c in app.get_system_commands(app.screen))
            for title in ("Play/pause (space)", "Step (n)", "Filter (/)", "Quit (q)"):
                assert title in titles
            # a replay takes no command: none is on offer
            assert "Pause (p)" not in titles and "Sync mode (m)" not in titles
            await pilot.press("m")
            assert not isinstance(app.screen, SyncScreen)
    run(scenario())


@pytest.mark.timeout(60)
def test_replay_steps_plays_and_changes_speed():
    async def scenario():
        source = ReplaySource(DDP_FEED, paused=True, preload=10)
        app = ConsoleApp(source)
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.replay_ready, what="the preload")
            assert app.state.messages == 10
            await pilot.press("n", "n")
            await until(pilot, lambda: app.state.messages == 12, what="two single steps")
            await pilot.press("plus", "plus", "minus")
            assert source.speed == 2.0
            await pilot.press("p")                     # hidden in a replay: does nothing, says nothing
            assert "commands are disabled" not in events_text(app)
            await pilot.press("space")
            await until(pilot, lambda: app.state.messages == source.total, what="the end of the log")
            await pilot.pause(0.2)
            assert "run finished: 60 steps" in events_text(app)
    run(scenario())


@pytest.mark.timeout(120)
def test_pause_and_resume_a_real_run(cli):
    from tests.test_control import current_step, start_live
    start_live(cli, "live", pause_ms=20)

    async def scenario():
        app = ConsoleApp(SocketSource("live"))
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.link_state == "connected" and app.state.step, timeout=30,
                        what="the console to attach")
            await pilot.press("p")
            await until(pilot, lambda: "pause: applied at step" in events_text(app), timeout=20, what="pause")
            assert app.state.paused
            held = current_step("live")
            await asyncio.sleep(1.0)
            assert current_step("live") == held
            await pilot.press("p")
            await until(pilot, lambda: "resume: applied" in events_text(app), timeout=20, what="resume")
            deadline = time.monotonic() + 20
            while current_step("live") <= held + 3:
                assert time.monotonic() < deadline, "no steps after resume"
                await asyncio.sleep(0.2)
            await pilot.press("q", "d")
        assert app.return_value == "detach"
    run(scenario())


@pytest.mark.timeout(120)
def test_bench_console_reports_every_figure(cli):
    r = cli.run("bench", "console", "--json", "--seconds", "2", "--presses", "3", timeout=110)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["commands_arrived"] == 3 and report["steps_per_s_shown"] > 0
    for figure in ("cpu_percent_of_one_core", "key_to_hub_ms_median", "key_to_hub_ms_max", "meets_goals"):
        assert figure in report


def test_the_header_shows_the_world_a_range_of_hosts_has_now_of_its_largest():
    """A run over `--nnodes 2:3` that lost a host: its new hello says world 2 of 3; a run of one size says its
    world alone."""
    state = RunState()
    state.apply({"type": "hello", "run": "r", "mode": "ddp", "world_size": 2, "max_world_size": 3})
    assert "ddp×2 of 3" in headline(state, wide=True, live=False).plain
    state = RunState()
    state.apply({"type": "hello", "run": "r", "mode": "ddp", "world_size": 3})
    assert "ddp×3 " in headline(state, wide=True, live=False).plain + " " and " of " not in \
        headline(state, wide=True, live=False).plain


@pytest.mark.timeout(60)
def test_a_replay_skips_a_cut_last_line_and_a_bad_one_and_says_so(tmp_path):
    lines = DDP_FEED.read_text().splitlines()
    feed = tmp_path / "cut.jsonl"   # 12 records, a bad line among them, and the 13th cut short
    feed.write_text("\n".join(lines[:5] + ["{not json", *lines[5:12]]) + "\n" + lines[12][:40])
    source = ReplaySource(feed, paused=True, preload=11)
    assert source.total == 12 and source.notes == [
        "cut.jsonl: line 6: not JSON (Expecting property name enclosed in double quotes)",
        "cut.jsonl: an incomplete last line (40 bytes): the writer stopped mid-record"]

    async def scenario():
        app = ConsoleApp(source)
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.replay_ready, what="the preload")
            await pilot.pause(0.2)
            text = events_text(app).replace("\n", "")   # as one line, however the panel wrapped it
            assert "replay" in text and "skipped cut.jsonl: line 6: not JSON" in text
            assert "cut.jsonl: an incomplete last line (40 bytes)" in text
    run(scenario())


def test_a_step_whose_loss_was_not_finite_shows_so():
    state = RunState()
    state.apply({"type": "hello", "run": "r", "mode": "ddp", "world_size": 2})
    state.apply({"type": "step", "step": 3, "loss": None, "samples_per_s": 10.0, "nonfinite": ["loss"]})
    assert "loss not finite" in headline(state, wide=True, live=False).plain
    state.apply({"type": "summary", "steps": 3, "final_loss": None})
    assert "final loss not finite" in state.take()[2][-1][0]


def test_the_header_says_tokens_a_second_and_mfu_where_samples_are_sequences():
    state = RunState()
    state.apply({"type": "hello", "run": "r", "mode": "ddp", "world_size": 1})
    state.apply({"type": "step", "step": 3, "loss": 2.0, "samples_per_s": 10.0, "tokens_per_s": 52310.4,
                 "mfu": 0.4123})
    wide, narrow = headline(state, wide=True, live=False).plain, headline(state, wide=False, live=False).plain
    assert "52,310 tokens/s" in wide and "MFU 41.2%" in wide and "samples/s" not in wide
    assert "52.3k tok/s" in narrow
    state.apply({"type": "step", "step": 4, "loss": 2.0, "samples_per_s": 10.0})   # images: samples a second
    assert "10 samples/s" in headline(state, wide=True, live=False).plain


def feed_with(tmp_path: Path, feed: Path, in_rows: dict, **run_start) -> Path:
    """`feed` rewritten into tmp_path: its run_start updated with `run_start` (a `strategy`, the hello's
    `figures`), and every full rank row given `in_rows` (name -> rank 0's value; rank r's is r + 1 times it)."""
    records = read_jsonl(feed)
    records[0].update(run_start)
    for record in records:
        for row in record.get("ranks") or []:
            row.update({name: value * (row["rank"] + 1) for name, value in in_rows.items()})
    path = tmp_path / feed.name
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def test_the_panels_figures_come_from_the_hellos_declarations():
    """A strategy's own figures come in its hello (the console imports nothing of a strategy); a hello from
    before `figures` gets every run's, engine.protocol's, and shows no strategy's own."""
    from engine.strategies.specs.figures import declared   # what the engine's hello says (the test's, not the console's)
    rows = [{"rank": 0, "reduce_ms": 0.5, "broadcast_wait_ms": 2.0, "wire_ms": 1.0},
            {"rank": 1, "reduce_ms": 1.25, "broadcast_wait_ms": None, "wire_ms": 3.0}]
    state = RunState()
    state.apply({"type": "hello", "run": "old", "mode": "sharded", "world_size": 2})   # from before `figures`
    state.apply({"type": "step", "step": 1, "loss": 1.0, "ranks": rows})
    assert state.figures == protocol.every_run() and state.panel_figures(protocol.STREAMS) == []
    state.apply({"type": "hello", "run": "sharded", "mode": "sharded", "world_size": 2,
                 "figures": declared("sharded")})
    state.apply({"type": "step", "step": 1, "loss": 1.0, "ranks": rows})
    assert state.panel_figures(protocol.STREAMS) == [("reduce", "ms", 1.25), ("broadcast wait", "ms", 2.0)]
    assert state.panel_figures(protocol.STREAMS, rank=0) == [("reduce", "ms", 0.5), ("broadcast wait", "ms", 2.0)]
    assert state.panel_figures(protocol.STAGES) == []
    # a run whose hello declares a figure this console never knew, and leaves reduce_ms off the panel
    wire = {"name": "wire_ms", "unit": "ms", "combine": "sum", "shows": ["log", "streams"], "optional": "absent",
            "label": "wire"}
    figures = [wire if d["name"] == "reduce_ms" else d for d in declared("sharded")]
    state.apply({"type": "hello", "run": "new", "mode": "sharded", "world_size": 2, "figures": figures})
    state.apply({"type": "step", "step": 1, "loss": 1.0, "ranks": rows})
    assert state.panel_figures(protocol.STREAMS) == [("wire", "ms", 4.0), ("broadcast wait", "ms", 2.0)]


@pytest.mark.timeout(60)
def test_the_streams_panel_shows_what_a_live_runs_hello_declares_it_shows(engines, tmp_path):
    from engine.strategies.specs.figures import declared
    wire = {"name": "wire_bytes", "unit": "bytes", "combine": "sum", "shows": ["log", "streams"], "optional": "",
            "label": "on the wire"}
    feed = feed_with(tmp_path, DDP_FEED, {"reduce_ms": 0.75, "broadcast_wait_ms": 1.5, "wire_bytes": 1024},
                     strategy="sharded", figures=[*declared("sharded"), wire])
    engines("sharded-figures", feed)

    async def scenario():
        app = ConsoleApp(SocketSource("sharded-figures", read_only=True))
        async with app.run_test(size=SIZE) as pilot:
            await attached(pilot, app)
            await until(pilot, lambda: "on the wire" in str(app.query_one("#streams-figures").content),
                        what="the streams panel's figures")
            line = str(app.query_one("#streams-figures").content)   # the slowest rank's, the ranks' bytes summed
            assert line == "reduce 1.50 ms · broadcast wait 3.00 ms · on the wire 3.0 KiB"
    run(scenario())


@pytest.mark.timeout(60)
def test_each_stage_shows_its_ranks_receive_wait_from_a_replayed_logs_declarations(tmp_path):
    """A replay learns what the panels show from the log's run_start, which carries the hello's `figures`."""
    from engine.strategies.specs.figures import declared
    feed = feed_with(tmp_path, PIPELINE_FEED, {"recv_wait_ms": 0.25}, figures=declared("pipeline"))

    async def scenario():
        app = ConsoleApp(ReplaySource(feed, paused=True, preload=26))
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.replay_ready, what="the preload")
            app.refresh_panels(force=True)
            await pilot.pause(0.2)
            header, labels, *lines = app.query_one(StagesPanel).render().plain.splitlines()
            assert labels.strip() == "· recv wait"   # over what each line's last value is
            assert [line.rsplit(" · ", 1)[1] for line in lines] == ["0.25 ms", "0.50 ms", "0.75 ms", "1.00 ms"]
    run(scenario())


def test_a_command_on_a_layer_names_its_stage_and_every_replica_of_it():
    from console.where import where_applied
    from tests.fleet_feed import pipeline_grid_feed
    grid_feed, one = pipeline_grid_feed(16, 4, "replica"), pipeline_grid_feed(4, 1)
    assert where_applied("set-policy", ["blocks.9", "swap"], grid_feed[0], last_step(grid_feed)) == \
        "blocks.9 is on stage 5: applied on each of its 4 replicas (ranks 5, 21, 37, 53)"
    assert where_applied("set-placement", ["head", "host"], one[0], last_step(one)) == "head is on stage 3"
    # before any step: the layout the run started in; the layer rows' stage where a step has none
    assert where_applied("set-policy", ["blocks.0", "keep"], grid_feed[0], None).startswith("blocks.0 is on stage 0")
    assert where_applied("set-policy", ["x", "keep"], {}, None, [{"name": "x", "stage": 2}]) == "x is on stage 2"
    assert where_applied("rebalance", [], grid_feed[0], last_step(grid_feed)) is None
    assert where_applied("set-policy", ["fc1", "swap"], {"layout": {"strategy": "ddp"}}, {"ranks": []}) is None
    owners = {"layout": {**grid_feed[0]["layout"], "grid": {**grid_feed[0]["layout"]["grid"], "owners": True}}}
    assert where_applied("set-placement", ["blocks.9", "host"], owners, last_step(grid_feed)) == \
        "blocks.9 is on stage 5: applied on the one of its 4 replicas that owns its update (ranks 5, 21, 37, 53)"


def last_step(messages: list[dict]) -> dict:
    return [msg for msg in messages if msg.get("type") == "step"][-1]


@pytest.mark.timeout(60)
def test_a_command_on_a_layer_of_a_grid_says_its_stage_and_every_replica_in_ctl_and_the_console(
        engines, tmp_path, capsys):
    from engine.ctl import ctl
    from tests.fleet_feed import pipeline_grid_feed, write_feed
    feed = write_feed(pipeline_grid_feed(2, 2), tmp_path / "grid.jsonl")
    engine = engines("grid", feed, capabilities=CAPABILITIES["pipeline"])   # embed, blocks.0 | blocks.1, head
    assert ctl("grid", "set-policy", ["blocks.0", "swap"], None, 10) == 0
    said = capsys.readouterr().out
    assert f"set-policy blocks.0 swap: applied at step {engine.step}" in said
    assert "blocks.0 is on stage 0: applied on each of its 2 replicas (ranks 0, 1)" in said
    assert ctl("grid", "pause", [], None, 10) == 0 and "stage" not in capsys.readouterr().out

    async def scenario():
        app = ConsoleApp(SocketSource("grid"))
        async with app.run_test(size=SIZE) as pilot:
            await attached(pilot, app)
            await select(pilot, app, "head")
            await pilot.press("u")
            await until(pilot, lambda: "set-placement head" in events_text(app) and "applied" in events_text(app),
                        what="the placement's reply")
            said = " ".join(events_text(app).split())   # the panel wraps its lines
            assert f"set-placement head host: applied at step {engine.step} — head is on stage 1: applied on each " \
                   "of its 2 replicas (ranks 2, 3)" in said
    run(scenario())
