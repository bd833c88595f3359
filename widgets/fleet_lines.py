"""What the Devices table's lines say: a rank's cells, a host's and the job's min/median/max, the
pinned outlier lines. Rich Text from fleet rows (widgets/fleet.py); the widget (widgets/device_table.py)
only places them on screen.

    keys, widths = fit_columns(cells_by_rank, column_keys(rows), width=96, sort_key="memory")
    joined(row_cells(row, outliers(rows).get(row["rank"], []), keys), keys, widths)   # one rank's line
    pinned_lines(rows, outliers(rows), header, width=96)   # the job's line, the outliers', the titles
    group_line("stage", 3, rows, width=96)   # '── stage 3 · ranks 12-15 · h1  memory ...': a group's line
"""

from __future__ import annotations

from rich.text import Text

from .bars import human_bytes, segment_bar
from .fleet import compute_of, memory_fraction, memory_of, outlier_groups, peak_of, rank_ranges, row_level, summarize

BAR_CELLS = 8
MAX_PINNED = 4      # outlier lines above the rows; more are counted on the last one
LEVEL_STYLES = {"crit": "bold red", "warn": "#ffb000", "stale": "dim"}
FLAGS = {"crit": ("●", "bold red"), "warn": ("●", "#ffb000"), "stale": ("○", "red")}
# a reason's first word -> the cell it colours
REASON_CELLS = {"memory": "memory", "peak": "memory", "over": "memory", "slow:": "compute", "step": "step",
                "wait": "wait", "waiting": "wait"}
# (key, title, right-justified, priority): a narrow panel drops the lowest priorities first
COLUMNS = [("flag", "", False, 200), ("rank", "rank", True, 100), ("label", "role", False, 60),
           ("replica", "replica", True, 95),   # a pipeline of several replicas only (column_keys)
           ("host", "host", False, 70), ("device", "device", False, 35), ("memory", "memory", False, 90),
           ("used", "used/total", True, 50), ("peak", "peak", True, 40), ("util", "util", True, 30),
           ("step", "step ms", True, 75), ("compute", "compute", True, 85), ("wait", "wait ms", True, 80),
           ("rss", "rss", True, 20)]   # the sort keys (fleet.SORT_KEYS) are column keys too
PRIORITY = {key: priority for key, _, _, priority in COLUMNS}
RIGHT = {key: right for key, _, right, _ in COLUMNS}
TITLES = {key: title for key, title, *_ in COLUMNS}


def _ms(value: float | None) -> Text:
    return Text("—", "dim") if value is None else Text(f"{value:.1f}")


def _memory(row: dict) -> Text:
    used, total = memory_of(row)
    fraction = memory_fraction(row)
    if fraction is None:
        return Text("—", "dim")
    colour = "red" if fraction > 0.9 else "#ffb000" if fraction > 0.8 else "#4c8dff"
    bar = segment_bar([(int(used), colour)], int(total), BAR_CELLS, None)
    return bar.append(f" {fraction:>4.0%}")


def _used(row: dict) -> Text:
    used, total = memory_of(row)
    if used is None:
        return Text("—", "dim")
    a, b = human_bytes(used), human_bytes(total)
    if a.partition(" ")[2] == b.partition(" ")[2]:   # one unit for both: the column stays narrow
        a = a.partition(" ")[0]
    return Text(f"{a}/{b}")


def _util(row: dict) -> Text:
    util = row.get("gpu_util_percent")
    return Text("—", "dim") if util is None else Text(f"{util:.0f}%")


CELLS = {
    "rank": lambda row: Text(str(row["rank"])),
    "label": lambda row: Text(row.get("label") or ""),
    "replica": lambda row: Text(str(row.get("replica", ""))),
    "host": lambda row: Text(f"h{row.get('host', 0)}"),
    "device": lambda row: Text(row.get("device") or "—"),
    "memory": _memory,
    "used": _used,
    "peak": lambda row: Text(human_bytes(peak_of(row))),
    "util": _util,
    "step": lambda row: _ms(row.get("step_ms")),
    "compute": lambda row: _ms(compute_of(row)),
    "wait": lambda row: _ms(row.get("wait_ms")),
    "rss": lambda row: Text(human_bytes(row.get("rss_bytes"))),
}


def row_cells(row: dict, reasons: list[str], keys: list[str]) -> dict[str, Text]:
    """The row's cells, those its reasons name coloured by their level; a stale row dimmed whole."""
    cells = {key: CELLS[key](row) for key in keys if key != "flag"}
    level = row_level(reasons)
    flag, style = FLAGS.get(level, (" ", ""))
    if reasons and all(reason.startswith("waiting") for reason in reasons):
        flag = "◦"   # only the consequence of another rank: quieter than its cause
    cells["flag"] = Text(flag, style)
    for reason in reasons:
        key = REASON_CELLS.get(reason.split(" ", 1)[0])
        if key in cells and key != "memory":   # the memory bar has its own colours
            cells[key].stylize(LEVEL_STYLES[row_level([reason])])
    if level == "crit" and "rank" in cells:
        cells["rank"].stylize("bold red")
    if level == "stale":
        for text in cells.values():
            text.stylize("dim italic")
    return cells


def summary_text(summary: dict) -> Text:
    """'memory 8/9/98%  step 10.1/10.3/16.0 ms  compute 9.2/9.4/15.2 ms': min/median/max of each."""
    text = Text()
    for key, title, unit, fmt in (("memory_percent", "memory", "%", "{:.0f}"), ("step_ms", "step", " ms", "{:.1f}"),
                                  ("compute_ms", "compute", " ms", "{:.1f}")):
        if summary.get(key) is not None:
            text.append(f"  {title} ", "dim").append("/".join(fmt.format(v) for v in summary[key]))
            text.append(unit, "dim")
    return text


def column_keys(rows: list[dict]) -> list[str]:
    """Every column; the role's only in a parameter-server run, the replica's only in a pipeline of several."""
    shown = {"label": any(row.get("label") for row in rows), "replica": any("replica" in row for row in rows)}
    return [key for key, *_ in COLUMNS if shown.get(key, True)]


def fit_columns(cells: dict[int, dict[str, Text]], keys: list[str], width: int,
                sort_key: str) -> tuple[list[str], dict[str, int]]:
    """The columns that fit `width` (the lowest priorities go first) and each one's width: its
    widest cell or its title (with the sort's arrow)."""
    widths = {key: max([len(TITLES[key]) + (key == sort_key) * 2,
                        *(row[key].cell_len for row in cells.values() if key in row)]) for key in keys}
    kept = set(keys)
    for key in sorted(keys, key=lambda k: PRIORITY[k]):
        if sum(widths[k] + 1 for k in kept) - 1 <= width:
            break
        kept.discard(key)
    keys = [key for key in keys if key in kept]
    return keys, {key: widths[key] for key in keys}


def joined(cells: dict[str, Text], keys: list[str], widths: dict[str, int]) -> Text:
    """One line: the cells padded to their columns' widths, numbers to the right."""
    line = Text()
    for n, key in enumerate(keys):
        cell = cells.get(key) or Text("")
        pad = " " * max(0, widths[key] - cell.cell_len)
        if n:
            line.append(" ")
        if RIGHT[key]:
            line.append(pad).append_text(cell)
        else:
            line.append_text(cell).append(pad)
    return line


def header(keys: list[str], widths: dict[str, int], sort_key: str) -> Text:
    """The column titles, the sorted one marked (▲ rank order, ▼ largest first)."""
    titles = {key: Text(TITLES[key] + ((" ▲" if key == "rank" else " ▼") if key == sort_key else ""))
              for key in keys}
    return joined(titles, keys, widths)


def group_line(field: str, value: int, rows: list[dict], width: int) -> Text:
    """'── host 3 · 8 ranks  memory 9/11/13%  step ...  ───': the host's min/median/max, across the width; a
    pipeline's stage names its replicas' ranks and their hosts, '── stage 3 · ranks 12-15 · h1  memory ...'."""
    if field == "stage":
        hosts = sorted({row.get("host", 0) for row in rows})
        where = f" · ranks {rank_ranges([row['rank'] for row in rows])} · " + ", ".join(f"h{h}" for h in hosts)
    else:
        where = f" · {len(rows)} ranks"
    line = Text.assemble(("── ", "dim"), (f"{field} {value}", "bold"), where, summary_text(summarize(rows)), " ")
    return line.append("─" * max(0, width - line.cell_len), "dim")



def pinned_lines(rows: list[dict], found: dict[int, list[str]], titles: Text, width: int) -> list[Text]:
    """The job's line, the outliers' (fleet.outlier_groups; MAX_PINNED at most), the column titles."""
    summary = summarize(rows)
    hosts = f" on {summary['hosts']} hosts" if summary["hosts"] > 1 else ""
    if any("stage" in row for row in rows):   # a pipeline of several replicas: its grid
        stages, replicas = (len({row[k] for row in rows if k in row}) for k in ("stage", "replica"))
        hosts += f", {stages} stages x {replicas} replicas"
    lines = [Text.assemble(("job", "bold"), f" {summary['ranks']} ranks{hosts}", ("  min/median/max", "dim"),
                           summary_text(summary))]
    groups = outlier_groups(found)
    if not groups:
        lines.append(Text("  no outliers (memory > 90%, compute, step or wait > 1.3x median, stale)", "dim"))
    by_rank = {row["rank"]: row for row in rows}
    for n, (ranks, reasons) in enumerate(groups):
        if n == MAX_PINNED - 1 and len(groups) > MAX_PINNED:
            rest = sum(len(r) for r, _ in groups[n:])
            lines.append(Text(f"  … {rest} more ranks stand out: sort (o) to see them first", "dim"))
            break
        flag, style = FLAGS[row_level(reasons)]
        if len(ranks) == 1:
            row = by_rank.get(ranks[0], {})
            where = f"h{row.get('host', 0)}"
            who = f"{row['label']} (rank {ranks[0]}, {where})" if row.get("label") else f"rank {ranks[0]} ({where})"
            lines.append(Text.assemble((flag, style), " ", (who, "bold"), "  ", ("  ·  ".join(reasons), style)))
        else:
            lines.append(Text.assemble((flag, style), " ", (f"{len(ranks)} ranks", "bold"), "  ",
                                       (" · ".join(reasons), style), ": ", rank_ranges(ranks)))
    lines.append(titles)
    for line in lines:
        line.truncate(width, overflow="ellipsis")
    return lines
