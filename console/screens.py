"""The console's dialogs: help, quit (detach or stop), run picker, layer filter, sync mode chooser,
and one rank's full device card (from the Devices table).

Each is a ModalScreen that dismisses with its answer; the app decides what the answer does.
Their styles live in app.tcss with the rest.
"""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, OptionList, Static
from textual.widgets.option_list import Option

from engine import protocol
from widgets.devices import DeviceCard


class HelpScreen(ModalScreen[None]):
    """Every key the console answers, built from the app's bindings so it never goes stale."""

    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "Close")]

    def __init__(self, keys: list[tuple[str, str]]) -> None:
        super().__init__()
        self.keys = keys

    def compose(self) -> ComposeResult:
        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold #ffb000", justify="right")
        table.add_column()
        for key, description in self.keys:
            table.add_row(key, description)
        with Vertical(id="help-box", classes="dialog"):
            yield Label("trainyard console — keys", classes="dialog-title")
            yield Static(table, id="help-keys")
            yield Label("layer keys act on the row selected in Layers · esc closes", classes="dialog-hint")

    def action_dismiss(self) -> None:
        self.dismiss(None)


class QuitScreen(ModalScreen[str]):
    """Detach (training goes on), stop the run, or cancel. Stop is final: the dialog says what it does,
    and nothing asks again."""

    BINDINGS = [Binding("escape", "choose('cancel')", "Cancel"), Binding("d", "choose('detach')", "Detach"),
                Binding("s", "choose('stop')", "Stop the run")]

    def __init__(self, run: str, can_stop: bool) -> None:
        super().__init__()
        self.run, self.can_stop = run, can_stop

    def compose(self) -> ComposeResult:
        with Vertical(id="quit-box", classes="dialog"):
            yield Label(f"Leave the console for {self.run}?", classes="dialog-title")
            yield Static("Stop: every rank writes a final checkpoint, then the run ends." if self.can_stop else
                         "Stop is off: this console is read-only or not connected.", id="quit-stop")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Detach (training goes on)", id="detach", variant="primary")
                yield Button("Stop the run", id="stop", variant="error", disabled=not self.can_stop)
                yield Button("Cancel", id="cancel")
            yield Label("d detach · s stop · esc cancel", classes="dialog-hint")

    @on(Button.Pressed)
    def pressed(self, event: Button.Pressed) -> None:
        self.action_choose(event.button.id or "cancel")

    def action_choose(self, choice: str) -> None:
        if choice != "stop" or self.can_stop:
            self.dismiss(choice)


class FilterScreen(ModalScreen[str | None]):
    """Type part of a layer name; enter applies, an empty filter shows every layer, esc cancels."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, current: str) -> None:
        super().__init__()
        self.current = current

    def compose(self) -> ComposeResult:
        with Vertical(id="filter-box", classes="dialog"):
            yield Label("Filter layers by name", classes="dialog-title")
            yield Input(self.current, placeholder="e.g. fc, blocks.3, attn", id="filter-input")
            yield Label("enter apply · empty shows all · esc cancel", classes="dialog-hint")

    @on(Input.Submitted)
    def submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip())

    def action_cancel(self) -> None:
        self.dismiss(None)


class DeviceCardScreen(ModalScreen[None]):
    """One rank's full card (the ledger's categories, the allocator, the bytes the ledger does not
    explain), opened with enter on the Devices table. `fetch()` gives what the card shows now, as
    DevicesPanel.card_data does: the card follows the run every second. Esc closes it."""

    BINDINGS = [Binding("escape,q", "dismiss", "Close")]
    FOLLOW_S = 1.0   # the devices panel gets new data at most once a second

    def __init__(self, rank: int, fetch) -> None:
        super().__init__()
        self.rank, self.fetch = rank, fetch

    def compose(self) -> ComposeResult:
        with Vertical(id="card-box", classes="dialog"):
            yield DeviceCard(self.rank, id="card")
            yield Label("esc closes · the figures follow the run", classes="dialog-hint")

    def on_mount(self) -> None:
        self.follow()
        self.set_interval(self.FOLLOW_S, self.follow)

    def follow(self) -> None:
        data = self.fetch()
        if data is not None:
            self.query_one(DeviceCard).update_data(*data)

    def action_dismiss(self) -> None:
        self.dismiss(None)


SYNC_HINTS = {
    "soft": "per-layer windows: fast workers never wait long for slow ones",
    "bsp": "bulk-synchronous: every update waits for every worker",
    "asp": "asynchronous: every gradient applied on arrival, no waiting",
    "ssp": "stale-synchronous: no worker more than the staleness bound ahead",
}


class SyncScreen(ModalScreen[str | None]):
    """The parameter server's sync modes, the current one marked; enter picks, esc cancels."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, modes: tuple[str, ...], current: str | None) -> None:
        super().__init__()
        self.modes, self.current = modes, current

    def compose(self) -> ComposeResult:
        options = [Option(Text.assemble(("● " if mode == self.current else "  ", "bold #ffb000"),
                                        (f"{mode:<5}", "bold"), (SYNC_HINTS.get(mode, ""), "dim"),
                                        ("  (current)" if mode == self.current else "", "#ffb000")), id=mode)
                   for mode in self.modes]
        with Vertical(id="sync-box", classes="dialog"):
            yield Label("Sync mode (set-sync)", classes="dialog-title")
            yield OptionList(*options, id="sync-modes")
            yield Label("↑↓ choose · enter sends set-sync · esc cancels", classes="dialog-hint")

    def on_mount(self) -> None:
        if self.current in self.modes:
            self.query_one(OptionList).highlighted = self.modes.index(self.current)

    @on(OptionList.OptionSelected)
    def chosen(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)

    def action_cancel(self) -> None:
        self.dismiss(None)


class RunPicker(ModalScreen[dict]):
    """The live runs on this machine (protocol.list_runs), refreshed every second; enter attaches."""

    BINDINGS = [Binding("escape,q", "app.exit", "Quit")]

    class Found(Message):
        def __init__(self, runs: list[dict]) -> None:
            super().__init__()
            self.runs = runs

    def compose(self) -> ComposeResult:
        with Vertical(id="picker-box", classes="dialog"):
            yield Label("Attach to a live run", classes="dialog-title")
            yield OptionList(id="picker-runs")
            yield Label("looking for live runs… (start one with `trainyard demo`)", id="picker-hint",
                        classes="dialog-hint")

    def on_mount(self) -> None:
        self.runs: list[dict] = []
        self.look()
        self.set_interval(1.0, self.look)

    @work(thread=True, exclusive=True)
    def look(self) -> None:
        try:
            runs = protocol.list_runs()
        except OSError as e:
            runs = [{"error": str(e)}]
        self.post_message(self.Found(runs))

    def on_run_picker_found(self, message: Found) -> None:
        runs = message.runs
        if runs and "error" in runs[0]:
            self.query_one("#picker-hint", Label).update(runs[0]["error"])
            return
        if [r["socket"] for r in runs] == [r["socket"] for r in self.runs]:
            return
        self.runs = runs
        options = self.query_one("#picker-runs", OptionList)
        options.clear_options()
        for info in runs:
            where = f"{info.get('mode', '?')} ×{info.get('world_size', '?')}  pid {info.get('pid')}"
            options.add_option(Option(Text.assemble((info["name"], "bold"), "  ", (where, "dim"))))
        hint = f"{len(runs)} live run(s) · enter attaches · esc quits" if runs else \
            "no live runs yet… (start one with `trainyard demo`)"
        self.query_one("#picker-hint", Label).update(hint)

    @on(OptionList.OptionSelected)
    def chosen(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(self.runs[event.option_index])
