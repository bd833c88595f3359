"""Which gradients make a layer's update on a parameter server, and how much each one counts.

    sync = LayerSync("soft", workers={2, 3, 4, 5}, scaling=True, bound=2)
    sync.window_s = {2: 0.004, ...}          # per worker: the profiled slack before it needs this layer again
    updates = sync.offer(Arrival(worker=2, version=17, t=now, grad=g))   # [] or [Update]
    updates += sync.due(now)                  # windows whose time is up
    sync.pull_ready(worker=2, iteration=40)   # may the worker have the weights now?

Pure logic, with time passed in: the server (engine/strategies/param_server/server.py) feeds it arrivals
and the clock; the tests feed it scripted arrival times.

Modes (docs/param_server.md):
- `soft`: a window opens at the earliest arrival t_min and accepts gradients until
  t_min + T, where T is the opening worker's profiled forward+backward time of the
  layers before this one: the time that worker has before it needs this layer's
  weights again, so waiting that long never delays it. Whatever arrived is applied
  together; later arrivals open the next window. A window also closes as soon as
  every live worker is in it.
- `bsp`: a window closes when every live worker is in it (synchronous data parallel).
- `asp`: every gradient is applied on arrival.
- `ssp`: every gradient is applied on arrival; a worker may pull for iteration k only
  while k - (the fewest gradients any live worker has pushed for this layer) <= bound.

Scaling: a gradient computed on weights s versions old counts lambda(s) = 1 / (1 + s)
(1 without staleness scaling). An update is  sum_i lambda(s_i) * g_i / n  where n is the
number of live workers in `bsp` and `soft`, and those who left after their gradient went into this
window (an update stands for a round of every worker,
so a window that caught k of them moves the weights k/n of a full step), and 1 in `asp`
and `ssp` (an update is one gradient; its staleness, about n - 1 there, scales it down).
In soft and bsp, s counts the full rounds' worth the layer's updates applied since the gradient's weights
were read (`unit="rounds"`, their scales summed), so a round split over more windows does not make the same
gradients staler; with `unit="versions"`, and always in asp and ssp, it counts those updates.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MODES = ("soft", "bsp", "asp", "ssp")
WINDOWED = ("soft", "bsp")


@dataclass
class Arrival:
    worker: int
    version: int          # the layer's version the gradient was computed on
    t: float              # arrival time, seconds (any monotonic clock)
    grad: torch.Tensor | None = None


@dataclass
class Update:
    """One applied update: the combined gradient and what went into it."""
    grad: torch.Tensor | None
    workers: list[int]
    staleness: list[float]   # versions, or full rounds' worth (LayerSync.staleness)
    scales: list[float]
    version: int          # the layer's version after this update
    window_s: float       # how long the window was open (0 for asp and ssp)

    @property
    def mean_staleness(self) -> float:
        return sum(self.staleness) / len(self.staleness) if self.staleness else 0.0


def staleness_scale(staleness: float, scaling: bool) -> float:
    return 1.0 / (1.0 + staleness) if scaling else 1.0


@dataclass
class _Window:
    opened: float
    deadline: float
    entries: list[Arrival] = field(default_factory=list)

    def has(self, worker: int) -> bool:
        return any(a.worker == worker for a in self.entries)


STALENESS_UNITS = ("versions", "rounds")
KEEP_VERSIONS = 4096    # rounds: how many versions' positions are kept (an older gradient counts in versions)


class LayerSync:
    def __init__(self, mode: str, workers: set[int], scaling: bool = True, bound: int = 2,
                 wait_limit_s: float = 30.0, version: int = 0, unit: str = "rounds"):
        if mode not in MODES:
            raise ValueError(f"sync mode {mode!r}; one of {', '.join(MODES)}")
        if unit not in STALENESS_UNITS:
            raise ValueError(f"staleness unit {unit!r}; one of {', '.join(STALENESS_UNITS)}")
        self.mode, self.scaling, self.bound, self.unit = mode, scaling, bound, unit
        self.moved = 0.0                       # rounds: the scales applied so far, summed (full rounds' worth)
        self.moved_at = {version: 0.0}         # rounds: version -> `moved` when it was made
        self.live = set(workers)
        self.wait_limit_s = wait_limit_s       # bsp: the longest a window waits for a live worker
        self.version = version
        self.window_s: dict[int, float] = {}  # soft: each worker's profiled slack for this layer
        self.window: _Window | None = None
        self.pending: list[Arrival] = []       # arrived too late for the open window, or twice
        self.pushed = {w: 0 for w in workers}  # gradients received per worker (ssp's clocks)

    # --- arrivals and the clock ------------------------------------------------------
    def offer(self, arrival: Arrival) -> list[Update]:
        if arrival.worker not in self.live:
            return []                          # a worker already given up on
        self.pushed[arrival.worker] = self.pushed.get(arrival.worker, 0) + 1
        if self.mode not in WINDOWED:
            return [self._apply([arrival], 0.0)]
        updates = self.due(arrival.t)          # a window whose time ended before this arrival
        self._place(arrival)
        if self._complete():
            updates += self._close(arrival.t)
        return updates

    def due(self, now: float) -> list[Update]:
        """Close the open window if its time is up at `now` (soft: its deadline; bsp: the wait limit)."""
        updates = []
        while self.window is not None and now > self.window.deadline:
            updates += self._close(self.window.deadline)
        return updates

    def next_deadline(self) -> float | None:
        return self.window.deadline if self.window is not None else None

    def missing(self) -> set[int]:
        """bsp: the live workers the open window still waits for."""
        return self.live - {a.worker for a in self.window.entries} if self.window else set()

    def pull_ready(self, worker: int, iteration: int) -> bool:
        if self.mode == "asp":
            return True
        if self.mode == "ssp":
            slowest = min((self.pushed.get(w, 0) for w in self.live), default=iteration)
            return iteration - slowest <= self.bound
        # bsp, soft: a worker whose gradient waits in a window gets the weights that include it
        waiting = (self.window is not None and self.window.has(worker)) or any(
            a.worker == worker for a in self.pending)
        return not waiting

    # --- changes ------------------------------------------------------------------
    def set_mode(self, mode: str, now: float) -> list[Update]:
        """Switch modes: what waits in a window is applied first."""
        if mode not in MODES:
            raise ValueError(f"sync mode {mode!r}; one of {', '.join(MODES)}")
        updates = self.flush(now)
        self.mode = mode
        return updates

    def flush(self, now: float) -> list[Update]:
        updates = []
        while self.window is not None:
            updates += self._close(now)
        return updates

    def lose(self, worker: int, now: float) -> list[Update]:
        """A worker died or went silent: windows stop waiting for it (its gradients already in stay)."""
        self.live.discard(worker)
        self.pending = [a for a in self.pending if a.worker != worker]
        if self.window is not None and self._complete():
            return self._close(now)
        return []

    # --- inside -------------------------------------------------------------------
    def _open(self, first: Arrival) -> None:
        if self.mode == "soft":
            length = self.window_s.get(first.worker, 0.0)
        else:
            length = self.wait_limit_s
        self.window = _Window(first.t, first.t + length, [first])

    def _complete(self) -> bool:
        return self.window is not None and not self.missing()

    def _close(self, now: float) -> list[Update]:
        window, self.window = self.window, None
        accepted = [a for a in window.entries if a.t <= window.deadline or now <= window.deadline]
        late = [a for a in window.entries if a not in accepted]
        updates = [self._apply(accepted, min(now, window.deadline) - window.opened)] if accepted else []
        queued, self.pending = sorted(late + self.pending, key=lambda a: a.t), []
        for arrival in queued:                 # the next window opens at the earliest of them
            self._place(arrival)
        return updates

    def _place(self, arrival: Arrival) -> None:
        """Into the open window, or open one; a worker already in it waits for the next."""
        if self.window is None:
            self._open(arrival)
        elif self.window.has(arrival.worker):
            self.pending.append(arrival)
        else:
            self.window.entries.append(arrival)

    def _apply(self, arrivals: list[Arrival], window_s: float) -> Update:
        # a worker that left after its gradient went in still counts in the round it took part in (a clean
        # BYE at the end of a run lands between two workers' last gradients for a layer)
        n = max(len(self.live | {a.worker for a in arrivals}), 1) if self.mode in WINDOWED else 1
        staleness = [self.staleness(a.version) for a in arrivals]
        scales = [staleness_scale(s, self.scaling) / n for s in staleness]
        grad = None
        for a, scale in zip(arrivals, scales):
            if a.grad is not None:
                grad = a.grad * scale if grad is None else grad.add_(a.grad, alpha=scale)
        self.version += 1
        self.moved += sum(scales)
        self.moved_at[self.version] = self.moved
        if len(self.moved_at) > KEEP_VERSIONS:
            for v in sorted(self.moved_at)[:KEEP_VERSIONS // 2]:
                del self.moved_at[v]
        return Update(grad, [a.worker for a in arrivals], staleness, scales, self.version, max(window_s, 0.0))

    def restore(self, version: int) -> None:
        """The layer's version from a checkpoint: staleness counts from it."""
        self.version, self.moved, self.moved_at = version, 0.0, {version: 0.0}

    def staleness(self, version: int) -> float:
        """How far this layer moved since `version`: its updates since (`versions`), or in a windowed mode with
        `rounds`, the full rounds' worth they applied (each update's scales summed: a window of k of n fresh
        gradients counts k/n), so that windows split finer do not make the same gradients staler. A version
        made before this process started, or long ago, counts in versions."""
        if self.unit == "rounds" and self.mode in WINDOWED and version in self.moved_at:
            return max(self.moved - self.moved_at[version], 0.0)
        return float(max(self.version - version, 0))
