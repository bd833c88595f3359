"""The console's key actions: the commands it sends for the operator (pause, policy, placement, sync), and
the rest (filter, sort, pages, help, leave, replay). Part of ConsoleApp (app.py), which holds the state, the
panels and the link these act on.

Imports console.screens and the widgets it drives.
"""

from __future__ import annotations

from console.client import ReplaySource
from console.screens import FilterScreen, HelpScreen, QuitScreen, SyncScreen
from engine.protocol import SYNC_MODES
from widgets.device_table import FleetTable
from widgets.layers import LayerTable

KEY_NAMES = {"slash": "/", "question_mark": "?", "plus": "+", "minus": "-"}


class ConsoleActions:
    """ConsoleApp's actions (a mixin: send_command, say, the state and the panels are the app's)."""

    def selected_layer(self, what: str) -> str | None:
        layer = self.table.selected_layer
        if layer is None:
            self.say(f"{what}: no layer selected — pick one in the Layers panel", "warning")
        return layer

    def action_pause(self) -> None:
        self.send_command("resume" if self.state.paused else "pause")

    def action_command(self, name: str) -> None:
        self.send_command(name)

    def action_policy(self, policy: str) -> None:
        if layer := self.selected_layer(f"set-policy {policy}"):
            self.send_command("set-policy", layer, policy)

    def action_placement(self) -> None:
        if layer := self.selected_layer("set-placement"):
            now = self.state.layer(layer).get("placement", "device")
            self.send_command("set-placement", layer, "device" if now == "host" else "host")

    def action_sync(self) -> None:
        """A chooser of the sync modes, the current one marked; the choice goes out as set-sync."""
        def chosen(mode: str | None) -> None:
            if mode is not None:
                self.send_command("set-sync", mode)
        self.push_screen(SyncScreen(SYNC_MODES, self.state.sync_mode), chosen)

    # --- everything else -----------------------------------------------------------------

    def action_filter(self) -> None:
        def chosen(text: str | None) -> None:
            if text is not None:
                self.table.set_filter(text)
                self.action_sort(cycle=False)
                self.page = "layers"
        self.push_screen(FilterScreen(self.table.filter_text), chosen)

    def action_sort(self, cycle: bool = True) -> None:
        table = self.table
        if cycle:
            table.cycle_sort()
        table.border_subtitle = table.caption()

    def action_page(self, page: str) -> None:
        self.page = page

    def action_help(self) -> None:
        keys = [(KEY_NAMES.get(b.key, b.key), b.tooltip or b.description)
                for b in (*self.BINDINGS, *LayerTable.BINDINGS)]   # the table's own: g, enter, z
        keys += [(KEY_NAMES.get(b.key, b.key), b.tooltip) for b in FleetTable.BINDINGS if b.show]   # Devices table
        self.push_screen(HelpScreen([*keys, ("ctrl+p", "command palette: every action by name")]))

    def action_leave(self) -> None:
        if isinstance(self.source, ReplaySource) or self.source is None:
            self.exit(None)
            return
        run = self.state.hello.get("run") or "the run"
        can_stop = self.link_state == "connected" and not self.read_only
        self.push_screen(QuitScreen(run, can_stop), self.leave_chosen)

    def leave_chosen(self, choice: str | None) -> None:
        if choice == "detach":
            self.exit("detach")
        elif choice == "stop":   # the dialog said what stop does: no second question
            self.stopping = self.send_command("stop")

    def action_replay(self, what: str) -> None:
        if what == "toggle":
            self.source.toggle()
        elif what == "step":
            self.source.step_once()
        else:
            self.notify(f"replay speed {self.source.change_speed(1 if what == 'faster' else -1):g}×", timeout=2)
