"""The console's key actions: the commands it sends for the operator (pause, policy, placement, sync), and
the rest (filter, sort, pages, help, leave, replay). ConsoleActions owns what was sent until its reply;
ConsoleApp (app.py) holds the state, the panels and the link these act on, and hands each key's action to
it (Textual looks a binding's `action_*` method up on the App).

Imports console.screens and the widgets it drives.
"""

from __future__ import annotations

from console.client import ReplaySource
from console.screens import FilterScreen, HelpScreen, QuitScreen, SyncScreen
from console.where import where_applied
from engine.protocol import SYNC_MODES
from widgets.device_table import FleetTable
from widgets.layers import LayerTable

KEY_NAMES = {"slash": "/", "question_mark": "?", "plus": "+", "minus": "-"}


class ConsoleActions:
    """What the keys of `app` (a ConsoleApp) do, and the commands they send, each said in the events panel
    and a notification until its final reply."""

    def __init__(self, app) -> None:
        self.app = app
        self.pending: dict[str, str] = {}      # command id -> what was sent, until its final reply
        self.sent: dict[str, tuple[str, list]] = {}   # command id -> (name, args), until its final reply
        self.stopping: str | None = None       # the id of the stop sent

    # --- commands ----------------------------------------------------------------------

    def say(self, text: str, severity: str = "information") -> None:
        """A line in the events panel and a notification, for everything a command does."""
        style = {"error": "bold red", "warning": "#ffb000"}.get(severity, "green" if "applied" in text else "")
        self.app.event_log.add_text(text, style)
        self.app.notify(text, severity=severity, timeout=4 if severity == "information" else 6)

    def refusal(self, name: str, label: str) -> str | None:
        """Why this console will not send `name` now, or None. Its keys are dimmed then (the app's
        check_action, which the command palette asks too), and send_command asks again."""
        app, state = self.app, self.app.state
        return ("replay: commands are disabled" if isinstance(app.source, ReplaySource) else
                "read-only: commands are disabled" if app.read_only else
                f"{label}: not sent — not connected" if app.link_state != "connected" else
                f"{label}: not available in mode {state.mode}" if name not in state.capabilities else None)

    def send_command(self, name: str, *args: str) -> str | None:
        """Send at once (the reply comes as a Feed message); None when refused here."""
        label = " ".join((name, *args))
        if refusal := self.refusal(name, label):
            self.say(refusal, "warning")
            return None
        try:
            cid = self.app.source.send(name, list(args))
        except (ConnectionError, OSError, AttributeError):
            self.say(f"{label}: not sent — not connected", "error")
            return None
        self.pending[cid], self.sent[cid] = label, (name, list(args))
        self.say(f"{label}: pending")
        return cid

    def on_reply(self, msg: dict) -> None:
        if msg.get("status") == "pending":
            return
        label = self.pending.pop(msg.get("id"), None) or msg.get("name", "command")
        name, args = self.sent.pop(msg.get("id"), (None, []))
        if msg.get("status") == "applied":
            state = self.app.state   # a pipeline: the layer's stage, and with replicas each replica of it
            where = name and where_applied(name, args, state.hello, state.last_step, state.layers)
            self.say(f"{label}: applied at step {msg.get('step')}" + (f" — {where}" if where else ""))
            if label in ("pause", "resume"):
                self.app.state.paused = label == "pause"
            if msg.get("id") == self.stopping:
                self.app.exit("stop")
        else:
            self.say(f"{label}: rejected: {msg.get('reason', 'no reason given')}", "error")
            if msg.get("id") == self.stopping:
                self.stopping = None

    def link_lost(self) -> None:
        """No reply will come to what is pending; a stop sent has done what it could."""
        for label in self.pending.values():
            self.say(f"{label}: no reply — the connection was lost", "warning")
        self.pending.clear()
        self.sent.clear()
        if self.stopping:
            self.app.exit("stop")

    # --- the keys that send commands -------------------------------------------------------

    def selected_layer(self, what: str) -> str | None:
        layer = self.app.table.selected_layer
        if layer is None:
            self.say(f"{what}: no layer selected — pick one in the Layers panel", "warning")
        return layer

    def pause(self) -> None:
        self.send_command("resume" if self.app.state.paused else "pause")

    def policy(self, policy: str) -> None:
        if layer := self.selected_layer(f"set-policy {policy}"):
            self.send_command("set-policy", layer, policy)

    def placement(self) -> None:
        if layer := self.selected_layer("set-placement"):
            now = self.app.state.layer(layer).get("placement", "device")
            self.send_command("set-placement", layer, "device" if now == "host" else "host")

    def sync(self) -> None:
        """A chooser of the sync modes, the current one marked; the choice goes out as set-sync."""
        def chosen(mode: str | None) -> None:
            if mode is not None:
                self.send_command("set-sync", mode)
        self.app.push_screen(SyncScreen(SYNC_MODES, self.app.state.sync_mode), chosen)

    # --- everything else -----------------------------------------------------------------

    def filter(self) -> None:
        table = self.app.table

        def chosen(text: str | None) -> None:
            if text is not None:
                table.set_filter(text)
                self.sort(cycle=False)
                self.app.page = "layers"
        self.app.push_screen(FilterScreen(table.filter_text), chosen)

    def sort(self, cycle: bool = True) -> None:
        table = self.app.table
        if cycle:
            table.cycle_sort()
        table.border_subtitle = table.caption()

    def help(self) -> None:
        keys = [(KEY_NAMES.get(b.key, b.key), b.tooltip or b.description)
                for b in (*self.app.BINDINGS, *LayerTable.BINDINGS)]   # the table's own: g, enter, z
        keys += [(KEY_NAMES.get(b.key, b.key), b.tooltip) for b in FleetTable.BINDINGS if b.show]   # Devices table
        self.app.push_screen(HelpScreen([*keys, ("ctrl+p", "command palette: every action by name")]))

    def leave(self) -> None:
        app = self.app
        if isinstance(app.source, ReplaySource) or app.source is None:
            app.exit(None)
            return
        run = app.state.hello.get("run") or "the run"
        can_stop = app.link_state == "connected" and not app.read_only
        app.push_screen(QuitScreen(run, can_stop), self.leave_chosen)

    def leave_chosen(self, choice: str | None) -> None:
        if choice == "detach":
            self.app.exit("detach")
        elif choice == "stop":   # the dialog said what stop does: no second question
            self.stopping = self.send_command("stop")

    def replay(self, what: str) -> None:
        source = self.app.source
        if what == "toggle":
            source.toggle()
        elif what == "step":
            source.step_once()
        else:
            self.app.notify(f"replay speed {source.change_speed(1 if what == 'faster' else -1):g}×", timeout=2)
