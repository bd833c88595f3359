"""The step boundary: every rank shares its figures, and rank 0 shares the operator's commands.

    table = exchange(topo, {"loss": 2.3, "stop": 0.0, ...}, command_bytes=len(payload))
    commands = share_commands(topo, payload, table)      # the same list on every rank
    column(table, "loss")                                # every rank's figure, as numbers
    table_rows(table)                                    # every rank's row (a Table's, or a tensor's: tests)
    RankFigures(table).column("step_ms")                 # rank 0's record: each figure written as the log writes it

One all-gather of a small float vector per step carries every figure declared to be exchanged (every
run's, engine/telemetry/figures.py: loss, timings, ledger figures, a GPU's allocator and NVML figures; and
each strategy's own, its spec's: engine/strategies/specs/figures.py), the stop flag and the length of rank
0's command payload; only when that length is non-zero does a broadcast of the payload follow. Both run on
the side group, so every rank sees the same commands at the same step and applies them there. A figure
reported but not declared stops the run (UndeclaredFigure).
"""

from __future__ import annotations

import json
from array import array

import torch
import torch.distributed as dist

from engine.runtime.topology import Topology
from engine.strategies.specs.figures import EXCHANGED, FIGURES, undeclared
from engine.telemetry.figures import CHECKPOINT_FIELDS, GPU_FIELDS, INTEGER_UNITS, LOG, WORDS  # noqa: F401
from engine.telemetry.records import figure_column

# the columns, declared by the figures' contributors (every run's and each strategy's: EXCHANGED; CHECKPOINT_FIELDS
# and GPU_FIELDS come from engine/telemetry/figures.py)
FIELDS = EXCHANGED
COLUMN = {name: i for i, name in enumerate(FIELDS)}


class Table:
    """Every rank's row of the step's figures, as numbers, by rank: what `exchange` returns, read by the
    boundary's readers (the stop flag, the commands' length, the plans, the checkpoint columns, the record) and
    never written. Numbers, not a tensor: each reader took its figure as a tensor operation of its own before,
    a dozen a step on the step's thread, and at world 1 the row's own list is the table, with no tensor made
    (a tensor and its 2-D view cost ~30 microseconds in the step loop, where the step before leaves their code
    cold; docs/training.md)."""

    __slots__ = ("rows",)

    def __init__(self, rows: list[list[float]]):
        self.rows = rows


def table_rows(table: Table | torch.Tensor) -> list[list[float]]:
    """The table as one list of numbers per rank (a tensor of rows too, as a test makes one)."""
    return table.rows if type(table) is Table else table.tolist()


def column(table: Table | torch.Tensor, name: str) -> list[float]:
    """Every rank's figure `name`, rank by rank."""
    i = COLUMN[name]
    return [row[i] for row in table_rows(table)]


class UndeclaredFigure(ValueError):
    """A figure reported to the exchange that nobody declares (engine/strategies/specs/figures.py)."""


_ABSENT = float("nan")
_DEFAULT = [_ABSENT if FIGURES[name].optional == "absent" else 0.0 for name in FIELDS]


def row_values(values: dict) -> list[float]:
    """`values` as one row of FIELDS: a missing figure is 0, or NaN where it may be absent (a GPU's: left out of
    rank_rows). A name not declared raises UndeclaredFigure: a figure silently dropped never reaches the log."""
    row, column = list(_DEFAULT), COLUMN
    for name, value in values.items():   # a step's few dozen figures, each where its column is
        i = column.get(name)
        if i is not None:
            row[i] = float(value)
        elif name not in WORDS:   # a device's kind and the like travel in words, not in the row
            raise UndeclaredFigure(f"figure(s) {', '.join(map(repr, undeclared(values)))} reported to the step "
                                   f"boundary's exchange but not declared: declare each with its contributor in "
                                   f"engine/telemetry/figures.py")
    return row


def exchange(topo: Topology, values: dict) -> Table:
    """All ranks' vectors, one row per rank (see row_values)."""
    row = row_values(values)
    if topo.world_size == 1:   # no peer to hear from: no collective, and the table is the row
        return Table([row])
    # the row's own bytes as the tensor (torch.tensor walks the list, ~25 microseconds more in the step loop)
    mine = torch.frombuffer(array("d", row), dtype=torch.float64)
    rows = [torch.empty_like(mine) for _ in range(topo.world_size)]
    dist.all_gather(rows, mine, group=topo.side)
    return Table(torch.stack(rows).tolist())


def encode_commands(commands: list[dict]) -> bytes:
    return json.dumps(commands).encode() if commands else b""


def share_commands(topo: Topology, payload: bytes, table: Table) -> list[dict]:
    nbytes = int(table_rows(table)[0][COLUMN["command_bytes"]])
    if nbytes == 0:
        return []
    if topo.world_size == 1:
        return json.loads(payload.decode())
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    if topo.is_first:
        buffer.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    dist.broadcast(buffer, src=0, group=topo.side)
    return json.loads(bytes(buffer.tolist()).decode())


def rank_rows(table: Table | torch.Tensor) -> list[dict]:
    """The table as one dict per rank (RankFigures.rows)."""
    return RankFigures(table).rows()


class RankFigures:
    """Every rank's logged figures, read from the boundary's table as far as a reader asks: a whole row, every
    rank's rows, or one figure of every rank. Each figure is written as its declaration says (bytes and counts
    as ints, flags as bools, ms to 4 decimals); one absent (NaN: a GPU's on a CPU rank), or absent while 0,
    is left out of a row and None in a column.

        ranks = RankFigures(table)
        ranks.row(0)                  # rank 0's row: {"rank": 0, "loss": ..., "step_ms": ..., ...}
        ranks.column("step_ms")       # every rank's, by rank
        ranks.rows()                  # every rank's row: a full step's `ranks`

    A step's record reads a dozen figures of every rank (its `per_rank` columns, the peaks, the stages), and
    every rank's ~50-figure row only on the steps that log full rows (`telemetry.rank_every`): at 64 ranks the
    rows cost rank 0 ~0.7 ms a step, the columns ~0.26 (`trainyard bench telemetry --record`, docs/training.md)."""

    __slots__ = ("_table", "_rows", "_columns")

    def __init__(self, table: Table | torch.Tensor):
        self._table = table_rows(table)
        self._rows: list[dict] | None = None
        self._columns: dict[str, list] = {}   # each read once: the record, the peaks and the columns share them

    def rows(self) -> list[dict]:
        if self._rows is None:
            self._rows = [self.row(rank) for rank in range(len(self._table))]
        return self._rows

    def row(self, rank: int) -> dict:
        if self._rows is not None:
            return self._rows[rank]
        entry = {"rank": rank}
        row = self._table[rank]
        for i, name, write, zero_absent in _LOGGED:
            value = row[i]
            if value != value or (zero_absent and not value):
                continue
            entry[name] = write(value)
        # the rank's own work (forward + backward, on the device's clock, less its waits for peers): a straggler
        # shows here, while its peers' wall step times equal its own (they wait for it). A strategy whose
        # backward holds a wait for peers (ddp's all-reduce) reports its own; the others' is fwd + bwd - gate.
        if not entry.get("compute_ms"):
            entry["compute_ms"] = _compute_ms(entry["fwd_ms"], entry["bwd_ms"], entry["gate_ms"])
        if len(self._table) == 1:   # the one row is every row: its columns are read from it
            self._rows = [entry]
        return entry

    def column(self, name: str) -> list:
        """Every rank's figure `name` as its row has it (None where the row leaves it out)."""
        if self._rows is not None:
            return [entry.get(name) for entry in self._rows]
        values = self._columns.get(name)
        if values is None:
            values = self._columns[name] = self._column(name)
        return values

    def _column(self, name: str) -> list:
        if name == "rank":
            return list(range(len(self._table)))
        if name == "compute_ms":   # as a row derives it where a rank reports none
            own = self._written("compute_ms")
            if all(own):
                return own
            fwd, bwd, gate = self.column("fwd_ms"), self.column("bwd_ms"), self.column("gate_ms")
            return [v or _compute_ms(fwd[r], bwd[r], gate[r]) for r, v in enumerate(own)]
        return self._written(name)

    def _written(self, name: str) -> list:
        logged = _LOGGED_BY_NAME.get(name)
        if logged is None:   # not a logged figure: no row has it
            return [None] * len(self._table)
        i, _, write, zero_absent = logged
        values = [row[i] for row in self._table]
        if zero_absent:
            return [write(v) if v == v and v else None for v in values]
        return [write(v) if v == v else None for v in values]


def _compute_ms(fwd_ms: float, bwd_ms: float, gate_ms: float) -> float:
    return round(max(fwd_ms + bwd_ms - gate_ms, 0.0), 4)


def _writer(unit: str):
    if unit == "flag":
        return bool
    if unit in INTEGER_UNITS:
        return int
    return (lambda v: round(v, 4)) if unit == "ms" else float


# per column a record has: (its index, name, how its value is written, whether a 0 means absent)
_LOGGED = [(i, name, _writer(FIGURES[name].unit), FIGURES[name].optional == "zero") for i, name in enumerate(FIELDS)
           if LOG in FIGURES[name].shows]
_LOGGED_BY_NAME = {logged[1]: logged for logged in _LOGGED}


class Peaks:
    """Rank 0: each rank's highest ledger peak over the run, and a GPU's allocator peak, for the summary."""

    def __init__(self, world_size: int):
        self.ledger = [0] * world_size
        self.allocator: dict[int, int] = {}
        self.compile: dict[int, tuple[float, int]] = {}   # rank -> (compile ms, recompiles): `[model] compile`

    def note(self, ranks: RankFigures | list[dict]) -> None:
        order, peaks = figure_column(ranks, "rank"), figure_column(ranks, "peak_bytes")
        for i, r in enumerate(order):
            self.ledger[r] = max(self.ledger[r], peaks[i] or 0)
        for i, peak in enumerate(figure_column(ranks, "allocator_peak_bytes")):
            if peak is not None:   # CUDA ranks
                self.allocator[order[i]] = max(self.allocator.get(order[i], 0), peak)
        compiled = figure_column(ranks, "compile_ms")
        if any(ms is not None for ms in compiled):   # cumulative, per process (engine/models/compile.py)
            recompiles = figure_column(ranks, "recompiles")
            for i, ms in enumerate(compiled):
                if ms is not None:
                    before_ms, n = self.compile.get(order[i], (0.0, 0))
                    self.compile[order[i]] = (max(before_ms, ms), max(n, int(recompiles[i] or 0)))

    def summary(self) -> dict:
        out = {"peak_bytes_per_rank": list(self.ledger)}
        if self.allocator:   # CUDA ranks: what the GPU's allocator really held at most (0: a CPU rank)
            out["allocator_peak_bytes_per_rank"] = [self.allocator.get(r, 0) for r in range(len(self.ledger))]
        if self.compile:   # the ranks compile side by side: the slowest one's is what the run waited
            per_rank = [round(self.compile.get(r, (0.0, 0))[0] / 1000, 3) for r in range(len(self.ledger))]
            out.update(compile_s=max(per_rank), compile_s_per_rank=per_rank,
                       recompiles=sum(n for _, n in self.compile.values()))
        return out
