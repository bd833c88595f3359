"""The live console: a run's devices, streams, stages, layers, curves and events, and its controls.

    trainyard console digits-ddp                  # attach; commands enabled
    trainyard console --read-only                 # the only live run (or a picker), watch only
    trainyard console --replay runs/digits-ddp/telemetry.jsonl
    python -m console ...                         # the same

A thread worker reads the socket (or plays the log back) and posts Feed and Link messages
(console/client.py); they only update a RunState, and the panels are redrawn from it ten
times a second. Wide terminals show every panel; narrow ones show a page at a time (1 2 3).
A parameter-server run adds the sync figures to the layers and devices, its sync mode to the
header, and `m` to change that mode (set-sync). The streams and stages panels also show the rank
figures the run's hello declares for them (sharded's reduce and broadcast waits, a stage's receive wait).

The line under the header says which keys do something in this run (state.keys_line). A key whose
command the run does not take (its hello's capabilities), or that this console may not send now
(--read-only, no live link), is shown dimmed in the footer and does nothing; a replay hides them.
"""

from __future__ import annotations

import time
from functools import partial

from rich.text import Text
from textual import on, work
from textual.actions import parse as parse_action
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.reactive import reactive
from textual.widgets import Footer, Static, Tab, Tabs
from textual.worker import get_current_worker

from console.actions import KEY_NAMES, ConsoleActions
from console.client import Feed, Link, ReplaySource, SocketSource
from console.screens import DeviceCardScreen, RunPicker
from console.state import RunState, headline, keys_line, link_label, replay_label
from engine import protocol
from widgets.curves import Curves
from widgets.device_table import FleetTable
from widgets.devices import DevicesPanel
from widgets.events import EventLog
from widgets.layers import LayerTable
from widgets.stages import StagesPanel
from widgets.streams import StreamsPanel

REFRESH_S = 0.1          # the header and the event log follow the latest state this often
# Panels get new data at most this often, and only while on screen: a repaint of 64 device cards
# or 200 table rows costs far more than a step message (measured by `trainyard bench console`).
# (period, phase): the phases keep two big repaints out of one frame, where a key would wait.
PANEL_SCHEDULE_S = {"devices": (1.0, 0.05), "streams": (0.5, 0.15), "curves": (0.5, 0.3), "stages": (0.5, 0.4),
                    "layers": (1.0, 0.55)}
PAGES = ("devices", "layers", "curves")
# the command each key's action sends (action "command" names it in its parameter)
ACTION_COMMANDS = {"pause": "pause", "policy": "set-policy", "placement": "set-placement", "sync": "set-sync"}
LAYER_KEYS = Binding.Group("Policy")   # k s c share one footer entry


class ConsoleApp(App[str]):
    """Exits with "detach", "stop" (the run was stopped) or None (a replay, or no run picked)."""

    CSS_PATH = "app.tcss"
    TITLE = "trainyard"
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (120, "-wide")]
    BINDINGS = [   # the footer's order: help and quit first, so a narrow screen never cuts them off
        Binding("question_mark", "help", "Help", tooltip="this list of keys"),
        Binding("q", "leave", "Quit", tooltip="quit: detach (training goes on) or stop the run"),
        Binding("space", "replay('toggle')", "Play/pause", tooltip="replay: play or pause"),
        Binding("n", "replay('step')", "Step", tooltip="replay: one record forward (pauses)"),
        Binding("plus", "replay('faster')", "Faster", tooltip="replay: faster"),
        Binding("minus", "replay('slower')", "Slower", tooltip="replay: slower"),
        Binding("p", "pause", "Pause", tooltip="pause or resume training (pause / resume)"),
        Binding("x", "command('checkpoint')", "Checkpoint", tooltip="write a checkpoint at the next step"),
        Binding("r", "command('rebalance')", "Rebalance", tooltip="re-split the pipeline's layers by their times"),
        Binding("k", "policy('keep')", "Keep", tooltip="selected layer: set-policy LAYER keep", group=LAYER_KEYS),
        Binding("s", "policy('swap')", "Swap", tooltip="selected layer: set-policy LAYER swap", group=LAYER_KEYS),
        Binding("c", "policy('recompute')", "Recompute", tooltip="selected layer: set-policy LAYER recompute",
                group=LAYER_KEYS),
        Binding("u", "placement", "Placement",
                tooltip="selected layer: move its optimizer update device <-> host (set-placement)"),
        Binding("m", "sync", "Sync mode", tooltip="parameter server: choose the sync mode, soft / bsp / asp / ssp "
                                                   "(set-sync)"),
        Binding("slash", "filter", "Filter", tooltip="filter the layers by name"),
        Binding("o", "sort", "Sort", show=False,
                tooltip="sort the layers: model order, fwd, bwd, activations, update (parameter server: "
                        "staleness, window), name"),
        Binding("1", "page('devices')", "Devices", show=False, tooltip="narrow screens: devices, streams, stages"),
        Binding("2", "page('layers')", "Layers", show=False, tooltip="narrow screens: layers and events"),
        Binding("3", "page('curves')", "Curves", show=False, tooltip="narrow screens: curves and events"),
    ]

    link_state = reactive("connecting")
    banner = reactive("")
    page = reactive("devices")

    def __init__(self, source: SocketSource | ReplaySource | None = None, *, read_only: bool = False,
                 token: str | None = None) -> None:
        super().__init__()
        self.source, self.read_only, self.token = source, read_only or bool(source and source.read_only), token
        self.state = RunState()
        self.actions = ConsoleActions(self)    # what the keys do, and the commands they sent
        self.replay_ready = False              # a replay has posted its preloaded records
        self._drawn: dict[str, tuple[int, float]] = {}   # panel -> (state version drawn, next slot)
        self._started = time.monotonic()
        self._points: list[tuple] = []         # curve points waiting for the curves' next turn

    def compose(self) -> ComposeResult:
        # kept as attributes: the timer draws into them while a dialog is the active screen
        self.status, self.link, self.banner_bar = Static(id="status"), Static(id="link"), Static(id="banner")
        self.keys = Static(id="keys")
        self.devices, self.streams = DevicesPanel(id="devices"), StreamsPanel(id="streams")
        self.stages, self.table = StagesPanel(id="stages"), LayerTable(id="layers")
        self.curves, self.event_log = Curves(id="curves"), EventLog(id="events")
        self.tabs = Tabs(*(Tab(f"{i} {p.title()}", id=f"tab-{p}") for i, p in enumerate(PAGES, 1)), id="pages")
        with Horizontal(id="top"):
            yield self.status
            yield self.link
        yield self.keys
        yield self.banner_bar
        yield self.tabs
        with Horizontal(id="panels", classes="-devices") as self.panels:
            with Vertical(id="left"):
                yield from (self.devices, self.streams, self.stages)
            with Vertical(id="right"):
                yield from (self.table, self.curves, self.event_log)
        yield Footer(show_command_palette=False)   # the palette is on ctrl+p and in help

    def on_mount(self) -> None:
        for panel in (self.devices, self.streams, self.stages, self.table, self.curves, self.event_log):
            panel.add_class("panel")
            panel.border_title = panel.id.title()
        self.table.border_subtitle = self.table.caption()
        self.table.focus()    # the layer keys act on its cursor row
        self.set_interval(REFRESH_S, self.refresh_panels)
        if self.source is None:
            self.push_screen(RunPicker(), self.attach)
        else:
            self.read_feed()

    def attach(self, info: dict | None) -> None:
        if info is None:
            self.exit(None)
            return
        self.source = SocketSource(info["socket"], read_only=self.read_only, token=self.token)
        self.read_feed()

    @work(thread=True, exclusive=True, group="feed")
    def read_feed(self) -> None:
        worker = get_current_worker()
        self.source.run(self.post_message, lambda: worker.is_cancelled)

    # --- the feed ----------------------------------------------------------------------

    def on_feed(self, message: Feed) -> None:
        msg = message.msg
        if msg.get("type") == "reply":
            self.actions.on_reply(msg)
        else:
            self.state.apply(msg)
            if msg.get("type") == "hello":   # its capabilities decide which keys are lit
                self.refresh_bindings()
            if msg.get("type") == "bye" and self.actions.stopping:
                self.exit("stop")

    def watch_link_state(self) -> None:
        self.refresh_bindings()   # the command keys are lit only while the link is up

    def on_link(self, link: Link) -> None:
        was = self.link_state
        self.link_state = link.state
        if link.state == "lost" or (link.state == "connecting" and link.detail):
            retry = f"next try in {link.retry_s:.1f} s" if link.retry_s else "retrying"
            self.banner = f"{link.detail} — reconnecting… ({retry})"
        else:
            self.banner = ""
        if link.state == "lost":
            self.actions.link_lost()
        elif link.state == "connected" and was == "lost":
            self.event_log.add_text("reconnected", "green")
        elif link.state == "replay":
            self.replay_ready = True
            if link.detail == "end of log":
                self.event_log.add_text("end of the log", "dim")

    def watch_banner(self, text: str) -> None:
        self.banner_bar.update(text)
        self.banner_bar.display = bool(text)

    def watch_page(self, page: str) -> None:
        for name in PAGES:
            self.panels.set_class(name == page, f"-{name}")
        self.tabs.active = f"tab-{page}"
        if page == "layers":
            self.table.focus()

    @on(Tabs.TabActivated)
    def tab_chosen(self, event: Tabs.TabActivated) -> None:
        self.page = event.tab.id.removeprefix("tab-")

    def refresh_panels(self, force: bool = False) -> None:
        """Draw the latest state: called on a timer, cheap when nothing changed. `force`: every
        panel now, off its schedule (tests, snapshots)."""
        if not self.is_running:   # shutting down: the panels' children are being taken away
            return
        state, hello = self.state, self.state.hello
        if state.new_run:
            self.curves.clear()
            state.new_run = False
        step, now = state.last_step or {}, float("inf") if force else time.monotonic()
        if self.due(self.devices, state.version, now):
            self.devices.update_ranks(step.get("ranks"), bool(hello.get("simulated", True)), state.ps,
                                      names=state.device_names, hosts=hello.get("hosts"), grid=state.grid)
        self.panels.set_class(self.devices.tabular, "-fleet")   # the table gets half the width (app.tcss)
        if self.due(self.streams, state.version, now):   # with the figures the run declares each panel shows
            self.streams.update_streams(step.get("streams"), state.mode, state.take_stream_steps(),
                                        state.panel_figures(protocol.STREAMS))
        if self.due(self.stages, state.version, now):
            stages = step.get("stages") or []   # each stage's figures are its rank's
            figures = [state.panel_figures(protocol.STAGES, s["rank"]) if "rank" in s else [] for s in stages]
            self.stages.update_stages(stages, state.mode, step.get("imbalance_ms"), step.get("threshold_ms"),
                                      bool(step.get("migrating")), figures)
        if self.due(self.table, state.layers_version, now):
            self.table.update_layers(state.layers, state.ps, state.grid)
        points, events, notes = state.take()
        self._points.extend(points)
        if (self._points or len(state.val_losses) != len(self.curves.val_losses)) \
                and self.due(self.curves, state.version, now):
            for point in self._points:
                self.curves.add_point(*point)
            self._points.clear()
            self.curves.set_validation(state.val_losses)
        self.log_lines(events, notes)
        live = not isinstance(self.source, ReplaySource) and self.link_state == "connected"
        self.show(self.status, headline(self.state, self.size.width >= 120, live))
        self.show(self.link, self.link_text())
        self.show(self.keys, keys_line(self.state, self.read_only, isinstance(self.source, ReplaySource)))

    def log_lines(self, events: list[dict], notes: list[tuple]) -> None:
        """A note with a time (the device the run chose, stamped with its start) goes before the
        events that came with it; the console's own notes, stamped now, after them."""
        for text, style, seconds in notes:
            if seconds is not None:
                self.event_log.add_line(EventLog.stamp(seconds).append(text, style))
        for event in events:
            self.event_log.add_event(event)
        for text, style, seconds in notes:
            if seconds is None:
                self.event_log.add_text(text, style)

    def due(self, panel, version: int, now: float) -> bool:
        """Whether `panel` should be given data of `version` now (see PANEL_SCHEDULE_S)."""
        period, phase = PANEL_SCHEDULE_S[panel.id]
        drawn, slot = self._drawn.get(panel.id, (-1, self._started + phase))
        if version == drawn or now < slot or not panel.region.area:
            return False
        self._drawn[panel.id] = (version, slot + period if now < slot + period else time.monotonic() + period)
        return True

    @staticmethod
    def show(static: Static, text: Text) -> None:
        """Update a header line only when it changed, and lay out only when its width did:
        a layout of the whole screen (64 device cards, say) costs far more than a repaint."""
        before = static.content
        if not isinstance(before, Text) or before.plain != text.plain or before.spans != text.spans:
            static.update(text, layout=not isinstance(before, Text) or before.cell_len != text.cell_len)

    def link_text(self) -> Text:
        if isinstance(src := self.source, ReplaySource):
            return replay_label(src.paused, self.state.messages, src.total, src.speed, self.size.width >= 120)
        return link_label(self.link_state, self.read_only)

    # --- the keys: Textual finds each binding's action_* on the App; ConsoleActions does it ---

    def action_pause(self) -> None:
        self.actions.pause()

    def action_command(self, name: str) -> None:
        self.actions.send_command(name)

    def action_policy(self, policy: str) -> None:
        self.actions.policy(policy)

    def action_placement(self) -> None:
        self.actions.placement()

    def action_sync(self) -> None:
        self.actions.sync()

    def action_filter(self) -> None:
        self.actions.filter()

    def action_sort(self, cycle: bool = True) -> None:
        self.actions.sort(cycle)

    def action_page(self, page: str) -> None:
        self.page = page

    def action_help(self) -> None:
        self.actions.help()

    def action_leave(self) -> None:
        self.actions.leave()

    def action_replay(self, what: str) -> None:
        self.actions.replay(what)

    @on(FleetTable.RankChosen)
    def rank_chosen(self, event: FleetTable.RankChosen) -> None:
        """Enter on the Devices table: that rank's full card, following the run."""
        self.push_screen(DeviceCardScreen(event.rank, partial(self.devices.card_data, event.rank)))

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        """True: the key works. None: shown dimmed, does nothing (a command this console will not send
        now, see ConsoleActions.refusal). False: hidden: the replay keys outside a replay, and the command
        keys in one (a replay takes no command, and with them its footer would be 160 columns wide)."""
        replay = isinstance(self.source, ReplaySource)
        if action == "replay":
            return replay
        command = parameters[0] if action == "command" and parameters else ACTION_COMMANDS.get(action)
        if command is None:
            return True
        return False if replay else None if self.actions.refusal(command, command) else True

    def get_system_commands(self, screen):
        """Every working key's action in the command palette (ctrl+p), named as in the footer."""
        yield from super().get_system_commands(screen)
        for b in self.BINDINGS:
            _, action, parameters = parse_action(b.action)
            if self.check_action(action, parameters):
                yield SystemCommand(f"{b.description} ({KEY_NAMES.get(b.key, b.key)})", b.tooltip,
                                    partial(self.run_action, b.action))
