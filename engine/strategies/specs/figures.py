"""Every run's figures and every registered strategy's own, as one list: what the boundary exchanges, what the
log's rank entries may carry, and what a run of one strategy declares in its hello.

    FIGURES["reduce_ms"]     # every figure by name: every run's (engine/telemetry/figures.py), then each strategy's
    EXCHANGED                # the boundary's columns, in order (engine/runtime/control.py FIELDS)
    LOGGED                   # the keys a step record's `ranks` entries may have (engine/telemetry/schema.py)
    PANEL_COLUMNS            # the figures the streams and stages panels show: `per_rank` columns every step
    undeclared({"loss": 1.0, "foo_ms": 2.0})   # ["foo_ms"]: a figure nobody declared
    declared("sharded")      # the hello's `figures`: every run's declarations, then sharded's own

A strategy's own figures are its spec's (StrategySpec.figures, in its package's spec.py): a fifth strategy's
join the exchange, the log's schema and its hello with no edit here. Torch-free, on the config's floor:
imports engine.telemetry.figures and the registry.
"""

from __future__ import annotations

from engine.strategies.specs.registry import STRATEGIES
from engine.telemetry.figures import FIGURES as EVERY_RUN
from engine.telemetry.figures import LOG, STAGES, STREAMS, WORDS, declarations

FIGURES = dict(EVERY_RUN)
for _spec in STRATEGIES.values():
    for _figure in _spec.figures:
        if _figure.name in FIGURES:
            raise ValueError(f"figure {_figure.name!r} of strategy {_spec.name!r} is declared twice: figure names "
                             f"are one namespace (the exchange's columns, the log's rank entries)")
        FIGURES[_figure.name] = _figure
EXCHANGED = tuple(f.name for f in FIGURES.values() if f.exchanged)
LOGGED = tuple(f.name for f in FIGURES.values() if LOG in f.shows)
PANEL_COLUMNS = tuple(f.name for f in FIGURES.values() if STREAMS in f.shows or STAGES in f.shows)
_EXCHANGED = frozenset(EXCHANGED) | frozenset(WORDS)


def undeclared(values: dict) -> list[str]:
    """The names in `values` the exchange has no column for (a figure nobody declared, or one not exchanged)."""
    if values.keys() <= _EXCHANGED:   # every step's case, in one set comparison
        return []
    return [k for k in values if k not in _EXCHANGED]


def declared(strategy: str) -> list[dict]:
    """The declarations of the figures a run of `strategy` writes into its rank entries, as JSON (the hello's
    `figures`): every run's, then the strategy's own (docs/protocol.md)."""
    spec = STRATEGIES.get(strategy)
    return declarations([*EVERY_RUN.values(), *(spec.figures if spec else ())])
