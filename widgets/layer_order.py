"""Which lines the layer table shows, in which order: pure functions of a step's `layers`.

    natural_key("blocks.2.attn") < natural_key("blocks.10.attn")    # digit runs compare as numbers
    arrange(rows, "model")                      # the rows as the step gave them: the model's forward order
    arrange(rows, "fwd", filter_text="attn")    # the costliest forward first, names containing "attn"
    arrange(rows, "model", grouped=True, folded={"stage 3"})
    # -> [Header("stage 0", ...), row, row, ..., Header("stage 3", folded=True), Header("stage 4"), row, ...]

Groups are per pipeline stage, per owner rank (sharded) or per server (parameter server): whichever
field the rows carry. A header sums its group's shown rows; a folded group shows its header alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# "model" first: a model's layers read in forward order; the figures next, so that one `o` finds the
# costliest layers; names (naturally sorted) last
SORTS = ["model", "fwd", "bwd", "act", "update", "staleness", "window", "name"]
SORT_FIELDS = {"fwd": "fwd_ms", "bwd": "bwd_ms", "act": "activation_bytes", "update": "update_ms",
               "staleness": "mean_staleness", "window": "window_ms"}
ALIASES = {"fwd_ms": "fwd", "bwd_ms": "bwd", "activation_bytes": "act", "act_mib": "act", "layer": "name",
           "update_ms": "update", "mean_staleness": "staleness", "window_ms": "window", "order": "model"}
# row field -> (header label of a value, of the rows without one); the first field the rows carry groups them
GROUPS = {"stage": ("stage {}", "no stage"), "owner_rank": ("rank {}", "no owner"),
          "server": ("server {}", "no server")}
HEADER = "\0group "   # prefixes a header's row key: never a layer name


def natural_key(name: str) -> tuple:
    """'act2' before 'act10', 'blocks.2.attn' before 'blocks.10.attn'; case only breaks ties."""
    parts = tuple((0, int(part), "") if part.isdigit() else (1, 0, part.casefold())
                  for part in re.split(r"(\d+)", name) if part)
    return parts, name


def sort_rows(rows: list[dict], sort: str) -> list[dict]:
    if sort == "model":
        return list(rows)
    if sort == "name":
        return sorted(rows, key=lambda r: natural_key(str(r["name"])))
    field = SORT_FIELDS[sort]
    return sorted(rows, key=lambda r: -(r.get(field) or 0.0))   # the costliest first; ties in model order


def group_field(rows: list[dict]) -> str | None:
    """`stage`, `owner_rank` or `server`: the first the rows carry, or None."""
    return next((field for field in GROUPS if any(row.get(field) is not None for row in rows)), None)


@dataclass(frozen=True)
class Header:
    """A group's line: its label, how many of its layers are shown, and their summed figures."""

    label: str
    layers: int
    fwd_ms: float | None
    bwd_ms: float | None
    activation_bytes: int | None
    folded: bool = False

    @property
    def key(self) -> str:
        return HEADER + self.label

    @classmethod
    def of(cls, label: str, rows: list[dict], folded: bool) -> Header:
        def total(field: str):
            values = [row[field] for row in rows if row.get(field) is not None]
            return sum(values) if values else None
        return cls(label, len(rows), total("fwd_ms"), total("bwd_ms"), total("activation_bytes"), folded)


def arrange(rows: list[dict], sort: str, filter_text: str = "", grouped: bool = False,
            folded: set[str] | frozenset[str] = frozenset()) -> list[dict | Header]:
    """The table's lines: the rows whose name contains `filter_text` (lower case), sorted; `grouped`:
    under a header per group, in the groups' order (those without the field last), sorted within."""
    shown = sort_rows([r for r in rows if filter_text in str(r.get("name", "")).lower()], sort)
    field = group_field(rows) if grouped else None
    if field is None:
        return shown
    groups: dict = {}
    for row in shown:
        groups.setdefault(row.get(field), []).append(row)
    named, nameless = GROUPS[field]
    lines: list[dict | Header] = []
    for value in sorted(groups, key=lambda v: (v is None, natural_key(str(v)))):
        label = nameless if value is None else named.format(value)
        header = Header.of(label, groups[value], label in folded)
        lines.append(header)
        if not header.folded:
            lines.extend(groups[value])
    return lines


def headers_of(lines: list[dict | Header]) -> dict[str, str]:
    """Each grouped layer's header key, by the layer's name."""
    out, header = {}, None
    for line in lines:
        if isinstance(line, Header):
            header = line.key
        elif header is not None:
            out[str(line["name"])] = header
    return out


def line_key(line: dict | Header) -> str:
    """The line's row key in the table: a layer's name, or its header's key."""
    return line.key if isinstance(line, Header) else str(line["name"])
