"""Memory in a line of text: byte counts and stacked bars, for the cards, the Devices table and the stages;
and any declared figure in its unit, for the streams and stages panels.

    human_bytes(1536)                                   # '1.5 KiB'
    figure_text(0.523, "ms")                            # '0.52 ms' (a figure's unit: engine.protocol.FIGURES)
    bytes_of(6.7 * 2**30, 79.6 * 2**30)                 # '6.7 / 79.6 GiB'
    segment_bar([(used, "#4c8dff")], capacity, 10, peak)   # a 10-cell Rich Text bar
"""

from __future__ import annotations

from itertools import groupby

from rich.text import Text


def human_bytes(n: float | None) -> str:
    """1536 -> '1.5 KiB'; three significant-ish digits, binary units."""
    if n is None:
        return "—"
    value, unit = float(n), "B"
    for next_unit in ("KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024:
            break
        value, unit = value / 1024, next_unit
    if unit == "B":
        return f"{int(value)} B"
    return f"{value:.0f} {unit}" if abs(value) >= 100 else f"{value:.1f} {unit}"


def figure_text(value: float | bool, unit: str) -> str:
    """A figure's value in its declared unit, in a few characters: ms to 2 decimals, bytes as human_bytes,
    a flag as yes / no, a count whole; a unit this console does not know as the bare number."""
    if unit == "ms":
        return f"{value:.2f} ms"
    if unit == "bytes":
        return human_bytes(value)
    if unit in ("percent", "core_percent"):
        return f"{value:.0f}%"
    if unit == "flag" or isinstance(value, bool):
        return "yes" if value else "no"
    if unit in ("count", "rank", "step", "errno"):
        return f"{value:,.0f}"
    return f"{value:.4g}"


def bytes_of(part: float | None, whole: float | None) -> str:
    """'6.7 / 79.6 GiB': one unit when both have it, so the line fits a narrow card."""
    a, b = human_bytes(part), human_bytes(whole)
    if a.partition(" ")[2] == b.partition(" ")[2] != "":
        a = a.partition(" ")[0]
    return f"{a} / {b}"


def signed_bytes(n: int) -> str:
    """512 MiB -> '+512 MiB': a difference, whose sign says which side holds more."""
    return f"+{human_bytes(n)}" if n > 0 else human_bytes(n)


def segment_bar(parts: list[tuple[int, str]], capacity: int, width: int,
                peak: int | None) -> Text:
    """A `width`-cell bar whose full width is `capacity`: one coloured run per part
    (bytes, style), `░` for the free rest, `┃` at the peak, `▶` in the last cell when
    the parts overflow the capacity. Boundaries round the running total, so the
    segments always add up to the used width."""
    width = max(1, width)
    total = sum(max(0, n) for n, _ in parts)
    scale = capacity if capacity > 0 else max(total, peak or 0, 1)
    cells: list[tuple[str, str]] = []
    running = 0
    for n, style in parts:
        start = min(width, round(running / scale * width))
        running += max(0, n)
        end = min(width, round(running / scale * width))
        cells.extend(("█", style) for _ in range(end - start))
    cells.extend(("░", "grey30") for _ in range(width - len(cells)))
    if peak is not None and peak > 0:
        col = min(width - 1, int(peak / scale * width))
        over = peak > scale
        bg = cells[col][1] if cells[col][0] == "█" else ""
        cells[col] = ("┃", ("bold red" if over else "bold bright_white") + (f" on {bg}" if bg else ""))
    if total > scale:
        cells[-1] = ("▶", "bold red")
    text = Text()
    for (char, style), run in groupby(cells):   # one span per run: cheap to render
        text.append(char * len(list(run)), style)
    return text
