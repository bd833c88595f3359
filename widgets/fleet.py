"""A job's ranks at a glance: their rows, outliers, summaries, order and filter, as pure functions.

The Devices table (widgets/device_table.py) only draws what these return; each has its tests in
tests/test_device_table.py.

    rows = fleet_rows(step["ranks"], simulated, ps=step.get("ps"), names=hello["devices"], hosts=hello["hosts"])
    outliers(rows)   # {0: ["waiting (on rank 41)"], ..., 41: ["memory 98%", "slow: compute 1.6x median"]}
    summarize(rows)                 # {"ranks": 64, "hosts": 8, "memory_percent": (8.4, 9.1, 98.0), "step_ms": ...}
    group_rows(filter_rows(rows, "h3"), "memory")   # [(3, host 3's rows, fullest first)]
    short_gpu_name("NVIDIA H100 80GB HBM3")         # 'H100 80GB'
    places(hello["layout"]["grid"])                 # {0: (0, 0), 1: (0, 1), ...}: a pipeline's rank -> (stage, replica)

A row is a step's rank entry (docs/telemetry.md, `ranks`) with `host`, `label` (a parameter-server
role, "worker 1"), `lost` and `device` (the short name) added, and in a pipeline of several replicas
(`grid`) its `stage` and `replica`. Every figure may be absent.
"""

from __future__ import annotations

import re
from statistics import median

from engine.protocol import GPU_FIELDS   # a CUDA rank's own figures: absent on a CPU rank

SORT_KEYS = ("rank", "memory", "step", "compute", "wait")   # `o` cycles them in this order
MEMORY_FRACTION = 0.90     # a rank above this share of its memory is an outlier
SLOW_RATIO = 1.3           # a figure above this multiple of its peers' median is an outlier ...
FLOOR_MS = 1.0             # ... when it is also this far above the median,
FLOOR_STEP_FRACTION = 0.05  # and this share of the median step: 0.2 ms against 0.1 ms is noise
MIN_PEERS = 3              # a median of fewer ranks says nothing
# reason -> level, by the reason's first word: what the table colours and the pinned lines order by
LEVELS = {"memory": "crit", "peak": "crit", "over": "crit", "slow:": "crit", "lost": "stale", "stale:": "stale",
          "step": "warn", "wait": "warn", "waiting": "warn"}
LEVEL_ORDER = ("crit", "stale", "warn")
_MARKETING = re.compile(r"^(nvidia|geforce|tesla|quadro|amd|radeon)$", re.I)   # the same on every card
_PACKAGING = re.compile(r"^(hbm\d*e?|pcie|sxm\d*|nvl|gddr\d*x?)$", re.I)       # form factor, memory type


def short_gpu_name(name: str | None) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'H100 80GB', 'NVIDIA A100-SXM4-80GB' -> 'A100 80GB',
    'NVIDIA GeForce RTX 4090' -> 'RTX 4090', "cpu (simulated device: ...)" -> 'cpu'; '' for None."""
    words = str(name or "").split(" (")[0].replace("-", " ").split()
    return " ".join(w for w in words if not _MARKETING.match(w) and not _PACKAGING.match(w))


def is_gpu(entry: dict) -> bool:
    return any(field in entry for field in GPU_FIELDS)


def device_label(entry: dict, name: str | None, simulated: bool) -> str:
    """The device column: a GPU's short name; 'simulated' (or 'cpu') for a rank whose memory is the ledger's."""
    if is_gpu(entry):
        return short_gpu_name(name) or "GPU"
    return "simulated" if simulated else "cpu"


def memory_of(row: dict) -> tuple[float | None, float | None]:
    """(used, total) bytes: NVML's whole-GPU figures where the row has them, else the ledger's."""
    if row.get("nvml_used_bytes") is not None and row.get("nvml_total_bytes"):
        return row["nvml_used_bytes"], row["nvml_total_bytes"]
    return row.get("used_bytes"), row.get("capacity_bytes")


def memory_fraction(row: dict) -> float | None:
    used, total = memory_of(row)
    return used / total if used is not None and total else None


def peak_of(row: dict) -> float | None:
    """The allocator's peak on a GPU (real bytes), the ledger's elsewhere."""
    peak = row.get("allocator_peak_bytes")
    return peak if peak is not None else row.get("peak_bytes")


def compute_of(row: dict) -> float | None:
    """The rank's busy time: `compute_ms` (on the device's clock), else forward + backward."""
    if row.get("compute_ms") is not None:
        return row["compute_ms"]
    fwd, bwd = row.get("fwd_ms"), row.get("bwd_ms")
    return fwd + bwd if fwd is not None and bwd is not None else None


def is_stale(row: dict) -> bool:
    """Its figures are older than the newest step's (`stale_steps`), or it is a lost worker."""
    return (row.get("stale_steps") or 0) > 0 or bool(row.get("lost"))


def ps_roles(ranks: list[dict], ps: dict) -> dict[int, dict]:
    """rank -> {"label": "server 0", "serves": [...]} or {"label": "worker 1", "worker": {...}}.

    Roles come from the rank rows' `role`; a rank in `ps.workers` is a worker whatever its row says.
    Servers and workers are numbered apart, in rank order; a server's number is the `server` of the
    layers it holds."""
    workers = {w["rank"]: w for w in ps.get("workers") or [] if isinstance(w.get("rank"), int)}
    lost = set(ps.get("workers_lost") or [])
    role_of = {entry["rank"]: entry.get("role") for entry in ranks}
    role_of.update({rank: "worker" for rank in [*workers, *lost] if isinstance(rank, int)})
    roles, counts = {}, {"server": 0, "worker": 0}
    for rank in sorted(role_of):
        role = role_of[rank]
        if role not in counts:
            continue
        label = f"{role} {counts[role]}"
        if role == "server":
            serves = [str(layer.get("name")) for layer in ps.get("layers") or [] if layer.get("server") == counts[role]]
            roles[rank] = {"label": label, **({"serves": serves} if ps.get("layers") else {})}
        else:
            worker = workers.get(rank)
            if rank in lost:
                worker = {**(worker or {"rank": rank}), "alive": False}
            roles[rank] = {"label": label, "worker": worker}
        counts[role] += 1
    return roles


def roles_of(ranks: list[dict], ps: dict | None) -> dict[int, dict]:
    """ps_roles where the run has roles (a `ps`, or rows with a `role`); {} otherwise."""
    return ps_roles(ranks, ps or {}) if ps is not None or any("role" in entry for entry in ranks) else {}


def places(grid: dict | None) -> dict[int, tuple[int, int]]:
    """rank -> (stage, replica), read from a pipeline's grid as the run says it (layout.grid: each stage's
    ranks, replica 0 first); {} without a grid or with one replica (a stage is then a rank)."""
    if not isinstance(grid, dict) or not isinstance(grid.get("ranks"), list) or (grid.get("replicas") or 1) < 2:
        return {}
    return {rank: (stage, replica) for stage, ranks in enumerate(grid["ranks"])
            for replica, rank in enumerate(ranks or []) if isinstance(rank, int)}


def with_lost_ranks(ranks: list[dict], roles: dict[int, dict]) -> list[dict]:
    """A lost worker may send no row any more: it keeps one, `{"rank": r}`, so that it stays on screen."""
    missing = set(roles) - {entry["rank"] for entry in ranks}
    if not missing:
        return ranks
    return sorted([*ranks, *({"rank": rank} for rank in missing)], key=lambda entry: entry["rank"])


def fleet_rows(ranks: list[dict], simulated: bool, ps: dict | None = None, names: list | None = None,
               hosts: list | None = None, grid: dict | None = None) -> list[dict]:
    """Each rank's entry with `host` (hello's `hosts`, by rank; 0 when unknown), `label` (its
    parameter-server role, or ''), `lost` and `device` (short name) added, in rank order; with a pipeline's
    `grid` of several replicas (hello's layout.grid), its `stage` and `replica` too."""
    roles, placed = roles_of(ranks, ps), places(grid)
    names, hosts = list(names or []), list(hosts or [])
    rows = []
    for entry in with_lost_ranks(ranks, roles):
        rank, role = entry["rank"], roles.get(entry["rank"], {})
        worker = role.get("worker")
        name = names[rank] if 0 <= rank < len(names) and isinstance(names[rank], str) else None
        host = hosts[rank] if 0 <= rank < len(hosts) and isinstance(hosts[rank], int) else 0
        label = role.get("label", "")
        rows.append({**entry, "role": entry.get("role") or (label.split()[0] if label else None), "host": host,
                     "label": label, "lost": worker is not None and not worker.get("alive", True),
                     "device": device_label(entry, name, simulated)})
        if rank in placed:
            rows[-1]["stage"], rows[-1]["replica"] = placed[rank]
    return sorted(rows, key=lambda row: row["rank"])


def _beyond(value: float | None, middle: float | None, floor_ms: float) -> bool:
    return value is not None and middle is not None and value > SLOW_RATIO * middle and value - middle > floor_ms


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return median(values) if values else None


def _times(value: float, middle: float) -> str:
    return f"{value / middle:.1f}x median" if middle > 0 else f"{value:.1f} ms, median 0"


def outliers(rows: list[dict]) -> dict[int, list[str]]:
    """rank -> why it stands out, for the ranks that do (rank order). The rules:

    - memory: above MEMORY_FRACTION of its total (memory_of: NVML's, else the ledger's) -> "memory 98%";
      the ledger's peak above it -> "peak 93%"; `over_capacity` -> "over capacity".
    - stale: `stale_steps` > 0 -> "stale: 3 steps old"; a lost parameter-server worker -> "lost".
    - among fresh peers (same `role`, and in a pipeline of several replicas the same `stage`: its stages
      differ by design; at least MIN_PEERS of them), against their median: compute
      (compute_of) above SLOW_RATIO x -> "slow: compute 1.6x median". In a synchronous job (no role)
      every rank's wall step is the slow rank's, so its peers show the delay as wait (waited_of: at the
      boundary, or inside the step beyond their compute): a peer that waits longer than the slow rank
      does -> "waiting (on rank 41)". Otherwise, on its own, a step or a wait
      above SLOW_RATIO x the median -> "step 1.4x median", "wait 1.9x median" (a parameter-server
      worker's steps differ: it is asynchronous).
    - the floor: a time is an outlier only when it is also more than FLOOR_MS and FLOOR_STEP_FRACTION
      of the median step above the median (or the slow rank's wait): a wait of 0.2 ms against a
      median of 0.1 ms is twice the median and still nothing.
    """
    found: dict[int, list[str]] = {}

    def flag(row: dict, reason: str) -> None:
        found.setdefault(row["rank"], []).append(reason)

    for row in rows:
        fraction = memory_fraction(row)
        peak, capacity = row.get("peak_bytes"), row.get("capacity_bytes")
        if fraction is not None and fraction > MEMORY_FRACTION:
            flag(row, f"memory {fraction:.0%}")
        elif peak is not None and capacity and peak / capacity > MEMORY_FRACTION and not row.get("over_capacity"):
            flag(row, f"peak {peak / capacity:.0%}")
        if row.get("over_capacity"):
            flag(row, "over capacity")
        if row.get("lost"):
            flag(row, "lost")
        elif (row.get("stale_steps") or 0) > 0:
            flag(row, f"stale: {row['stale_steps']} step{'s' if row['stale_steps'] != 1 else ''} old")
    groups: dict = {}
    for row in rows:
        if not is_stale(row):
            groups.setdefault((row.get("role"), row.get("stage")), []).append(row)
    for (role, _), peers in groups.items():
        if len(peers) >= MIN_PEERS:
            _timing_outliers(peers, synchronous=role is None, flag=flag)
    return {rank: found[rank] for rank in sorted(found)}


def waited_of(row: dict) -> float:
    """The ms a rank spent not computing: its wait at the boundary, and the rest of its step beyond its compute
    (ddp waits inside backward for the all-reduce, sharded in its reduce: a straggler's peers wait there)."""
    compute, step = compute_of(row), row.get("step_ms")
    inside = max(step - compute, 0.0) if compute is not None and step is not None else 0.0
    return (row.get("wait_ms") or 0.0) + inside


def _timing_outliers(peers: list[dict], synchronous: bool, flag) -> None:
    step_median = _median(row.get("step_ms") for row in peers)
    compute_median = _median(compute_of(row) for row in peers)
    wait_median = _median(row.get("wait_ms") for row in peers)
    floor_ms = max(FLOOR_MS, FLOOR_STEP_FRACTION * (step_median or 0.0))
    slow = sorted((row for row in peers if _beyond(compute_of(row), compute_median, floor_ms)),
                  key=lambda row: -compute_of(row))
    for row in slow:
        flag(row, f"slow: compute {_times(compute_of(row), compute_median)}")
    slow_ranks, waiting = {row["rank"] for row in slow}, set()
    if synchronous and slow:
        on = ", ".join(str(row["rank"]) for row in slow[:3]) + (", …" if len(slow) > 3 else "")
        reason = f"waiting (on rank{'s' if len(slow) > 1 else ''} {on})"
        slow_wait = max(waited_of(row) for row in slow)
        for row in peers:
            if row["rank"] not in slow_ranks and waited_of(row) - slow_wait > floor_ms:
                flag(row, reason)
                waiting.add(row["rank"])
    for row in peers:
        if row["rank"] in slow_ranks:
            continue
        if _beyond(row.get("step_ms"), step_median, floor_ms):
            flag(row, f"step {_times(row['step_ms'], step_median)}")
        if row["rank"] not in waiting and _beyond(row.get("wait_ms"), wait_median, floor_ms):
            flag(row, f"wait {_times(row['wait_ms'], wait_median)}")


def reason_level(reason: str) -> str:
    """'crit' (memory, a slow rank), 'stale' (stale, lost) or 'warn' (step, wait)."""
    return LEVELS.get(reason.split(" ", 1)[0], "warn")


def row_level(reasons: list[str]) -> str | None:
    """The most severe level of a rank's reasons; None when it has none."""
    levels = {reason_level(reason) for reason in reasons}
    return next((level for level in LEVEL_ORDER if level in levels), None)


def outlier_groups(found: dict[int, list[str]]) -> list[tuple[list[int], list[str]]]:
    """The pinned lines: ranks with the same reasons share a line ("63 ranks waiting (on rank 41)"),
    the most severe first, then single ranks before crowds, then by rank."""
    groups: dict[tuple, list[int]] = {}
    for rank, reasons in found.items():
        groups.setdefault(tuple(reasons), []).append(rank)
    return sorted(((ranks, list(reasons)) for reasons, ranks in groups.items()),
                  key=lambda g: (LEVEL_ORDER.index(row_level(g[1]) or "warn"), len(g[0]), g[0][0]))


def rank_ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 3, 5, 7, 8] -> '0-3, 5, 7-8'."""
    spans: list[list[int]] = []
    for rank in sorted(ranks):
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def spread(values) -> tuple[float, float, float] | None:
    """(min, median, max) of the values that are not None; None when there are none."""
    values = sorted(v for v in values if v is not None)
    return (values[0], median(values), values[-1]) if values else None


def summarize(rows: list[dict]) -> dict:
    """{"ranks", "hosts", "memory_percent", "step_ms", "compute_ms"}: counts, then (min, median, max)
    of each figure over the rows that have it (None when none has)."""
    fractions = (memory_fraction(row) for row in rows)
    return {"ranks": len(rows), "hosts": len({row.get("host", 0) for row in rows}),
            "memory_percent": spread(None if f is None else 100 * f for f in fractions),
            "step_ms": spread(row.get("step_ms") for row in rows),
            "compute_ms": spread(compute_of(row) for row in rows)}


SORT_VALUES = {"memory": memory_fraction, "step": lambda row: row.get("step_ms"), "compute": compute_of,
               "wait": lambda row: row.get("wait_ms")}


def sort_rows(rows: list[dict], key: str) -> list[dict]:
    """By rank, or by a figure, largest first (rows without it last; ties by rank)."""
    if key == "rank":
        return sorted(rows, key=lambda row: row["rank"])
    if key not in SORT_VALUES:
        raise ValueError(f"sort key must be one of {', '.join(SORT_KEYS)}, got {key!r}")
    value = SORT_VALUES[key]
    return sorted(rows, key=lambda row: (value(row) is None, -(value(row) or 0.0), row["rank"]))


def next_sort(key: str) -> str:
    return SORT_KEYS[(SORT_KEYS.index(key) + 1) % len(SORT_KEYS)] if key in SORT_KEYS else SORT_KEYS[0]


def group_field(rows: list[dict]) -> str:
    """What the table groups by: "stage" in a pipeline of several replicas (the rows carry one), else "host"."""
    return "stage" if any("stage" in row for row in rows) else "host"


def group_rows(rows: list[dict], key: str, field: str = "host") -> list[tuple[int, list[dict]]]:
    """[(host, its rows sorted by `key`)] (or by `field`, "stage": [(stage, its replicas' rows)]): by number
    for "rank", else the group whose top row comes first in sort_rows first, so that the largest figure of
    the job is always the first row."""
    groups: dict[int, list[dict]] = {}
    for row in sort_rows(rows, key):
        groups.setdefault(row.get(field, 0), []).append(row)
    return sorted(groups.items()) if key == "rank" else list(groups.items())


def filter_rows(rows: list[dict], text: str) -> list[dict]:
    """Keep the rows `text` names: "host 3" or "h3" (a host), "41" or "rank 41" (a rank), "stage 2" or "s2"
    (a pipeline's stage), several with commas ("h3, 41"), or else a piece of a role or device ("worker",
    "H100"). '' keeps every row."""
    wanted = [part.strip().lower() for part in text.split(",") if part.strip()]
    if not wanted:
        return list(rows)

    def named(row: dict, part: str) -> bool:
        if m := re.fullmatch(r"(?:host\s*|h)(\d+)", part):
            return row.get("host", 0) == int(m.group(1))
        if m := re.fullmatch(r"(?:stage\s*|s)(\d+)", part):
            return row.get("stage") == int(m.group(1))
        if m := re.fullmatch(r"(?:rank\s*|r)?(\d+)", part):
            return row["rank"] == int(m.group(1))
        return part in str(row.get("label", "")).lower() or part in str(row.get("device", "")).lower()

    return [row for row in rows if any(named(row, part) for part in wanted)]
