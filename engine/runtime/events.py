"""What a technique or a strategy has to say after a step, made where it happened and forwarded unread by the
step loop (engine/run/worker.py) to the telemetry (docs/telemetry.md: event records, notes, the hub's state).

    events = strategy.events(step, table, run_dir)   # e.g. a migration: its record, its note, the new layout
    forward(tel, step, events)                       # every rank; only rank 0's telemetry writes anything

Imports nothing of the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Event:
    kind: str | None = None                   # an event record's kind (None: a note, a state or a reply alone)
    fields: dict = field(default_factory=dict)
    note: str | None = None                   # a line in the console's events panel and the headless log
    state: dict | None = None                 # fields of the state a console reads on connecting
    reply: tuple[dict, str, dict] | None = None   # (command, status, fields): an operator's command answered
    file: tuple[Path, str] | None = None      # (path, text): written before the record that names it


def forward(tel, step: int, events: list[Event]) -> None:
    for e in events:
        if e.file is not None and tel.writes:
            e.file[0].write_text(e.file[1])
        if e.kind is not None:
            tel.event(e.kind, step, **e.fields)
        if e.state:
            tel.update_state(**e.state)
        if e.note:
            tel.note(e.note)
        if e.reply is not None:
            command, status, fields = e.reply
            tel.reply(command, status, step=step, **fields)
