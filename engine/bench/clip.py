"""`--clip-grad-norm X` of `trainyard bench hybrid` and `trainyard bench broadcast` (issue 32): what clipping
the global gradient norm costs a step, and what speculating on it saves. Each bench runs a few of its variants
in three modes, the modes of a variant back to back in every round (same process tree, same config otherwise):

    none       optim.clip_grad_norm = 0, optim.skip_nonfinite = false: no step guard at all
    wait       optim.clip_grad_norm = X, optim.clip_mode = "wait": the updates are held until the norm is known
    speculate  optim.clip_grad_norm = X, optim.clip_mode = "speculate": each update runs as soon as its gradient
               is ready, keeping a copy, rolled back and redone when the norm says clip

Figures per variant: each mode's median step time; wait/none, speculate/none, speculate/wait; for wait and
speculate the rollback rate (timed steps with `redone_layers` > 0, over the timed steps) and the clipped rate
(steps with `clipped`), counted from the fields every step record carries (step_guard.py GuardDecision.fields(),
which engine/run/worker.py writes into the telemetry log). A variant that cannot speculate (sharded: its
owners update after the reduce, so the norm is known before any update) runs none and wait only.

Goals, each judged only where it applies (else not judged, with the reason):
    speculate/none <= 1.05   when the speculative run rolled back no step
    speculate <= wait        where host updates overlap backward, when not every step rolled back
    speculate <= wait        when every step clipped (clipped rate 1.0): speculating costs no more than waiting
"""

from __future__ import annotations

import statistics

MODES = ("none", "wait", "speculate")
SPECULATE_OVER_NONE_AT_MOST = 1.05


def add_precision_and_clip(parser, compared: str, clip_runs: str) -> None:
    """The `--precision` and `--clip-grad-norm` flags bench broadcast and bench hybrid share: `compared`
    says what bf16 adds to the report, `clip_runs` what the clip runs are instead of the bench's own."""
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                        help=f"bf16: the bench in fp32 and in bf16 side by side, with {compared} and the bf16/fp32 "
                             f"ratios (default fp32: fp32 only)")
    parser.add_argument("--clip-grad-norm", type=float, default=None, metavar="X",
                        help=f"instead of the bench's own runs: {clip_runs}, with their rollback rates "
                             f"(engine/bench/clip.py)")


def check_precision_and_clip(parser, args) -> None:
    if args.clip_grad_norm is not None and args.clip_grad_norm <= 0:
        parser.error("--clip-grad-norm: must be > 0 (the threshold the wait and speculate runs clip at)")
    if args.clip_grad_norm is not None and args.precision != "fp32":
        parser.error("--clip-grad-norm runs in fp32: leave out --precision")


def ratio(a, b, digits: int = 3):
    """a / b rounded, None where either is missing or b is 0 (every bench's ratios)."""
    return None if a is None or not b else round(a / b, digits)


def optim_keys(mode: str, clip: float) -> dict:
    """The [optim] keys of `mode` at threshold `clip`, set over the bench's own optimizer settings."""
    if mode == "none":
        return {"clip_grad_norm": 0.0, "skip_nonfinite": False}
    return {"clip_grad_norm": clip, "clip_mode": mode}


class GuardTally:
    """The timed steps' guard fields, read after each step as the step record reads them."""

    def __init__(self):
        self.steps = self.rolled_back = self.clipped = 0
        self.grad_norms: list[float] = []

    def add(self, runner) -> None:
        fields = runner.updater.decision.fields()
        self.steps += 1
        self.rolled_back += fields["redone_layers"] > 0
        self.clipped += fields["clipped"]
        if fields["grad_norm"] is not None:
            self.grad_norms.append(fields["grad_norm"])

    def figures(self) -> dict:
        return {"steps": self.steps, "rolled_back_steps": self.rolled_back, "clipped_steps": self.clipped,
                "grad_norms": self.grad_norms}


def variant_row(variant: str, runs: dict[str, list[dict]], overlap: bool) -> dict:
    """One variant's figures from its runs (mode -> one result a round, each with `step_ms` and `guard`, a
    GuardTally's figures); `overlap`: its host updates overlap backward (the goal speculate <= wait applies)."""
    modes = [m for m in MODES if runs.get(m)]
    ms = {m: statistics.median(r["step_ms"] for r in runs[m]) for m in modes}

    def rate(mode: str, key: str) -> float:
        return round(sum(r["guard"][key] for r in runs[mode]) / sum(r["guard"]["steps"] for r in runs[mode]), 4)
    guarded = [m for m in modes if m != "none"]
    norms = [n for m in guarded for r in runs[m] for n in r["guard"]["grad_norms"]]
    ratios = {"wait_over_none": ratio(ms["wait"], ms["none"])}
    if "speculate" in ms:
        ratios.update(speculate_over_none=ratio(ms["speculate"], ms["none"]),
                      speculate_over_wait=ratio(ms["speculate"], ms["wait"]))
    row = {"variant": variant, "step_ms": {m: round(ms[m], 2) for m in modes},
           "rollback_rate": {m: rate(m, "rolled_back_steps") for m in guarded},
           "clipped_rate": {m: rate(m, "clipped_steps") for m in guarded},
           "timed_steps": sum(r["guard"]["steps"] for r in runs["wait"]),
           "grad_norm_median": round(statistics.median(norms), 4) if norms else None,
           "ratios": ratios, "host_updates_overlap_backward": overlap, "meets_goals": {}, "not_judged": {}}
    if "speculate" in ms:
        row["meets_goals"], row["not_judged"] = _goals(ratios, row["rollback_rate"]["speculate"],
                                                       row["clipped_rate"]["speculate"], overlap)
    return row


def _goals(ratios: dict, rollback: float, clipped: float, overlap: bool) -> tuple[dict, dict]:
    """Each goal: met (True), missed (False) or not judged on this run (None; its reason in the second dict).
    Clipping on every step is judged by the clipped rate: after a clipped step a speculative run waits until 10
    steps in a row stand (engine/techniques/updates/updater.py), so it rolls back once, not every step."""
    spec_le_wait = ratios["speculate_over_wait"] <= 1.0
    rate, clip_rate = f"rollback rate {rollback:.2f}", f"clipped rate {clipped:.2f}"
    goals = [   # name, met, judged on this run, else why not
        ("speculate_within_5pct_of_none_without_rollbacks",
         ratios["speculate_over_none"] <= SPECULATE_OVER_NONE_AT_MOST, rollback == 0 and clipped == 0,
         f"{rate}, {clip_rate}"),
        ("speculate_at_most_wait_host_overlapping_backward", spec_le_wait, overlap and clipped < 1,
         clip_rate if overlap else "no host updates"),
        ("speculate_at_most_wait_every_step_clipped", spec_le_wait, clipped == 1, clip_rate)]
    return ({name: met if judged else None for name, met, judged, _ in goals},
            {name: why for name, _, judged, why in goals if not judged})


def print_rows(console, Table, title: str, rows: list[dict], caption: str | None = None) -> None:
    """The variants' table, then each variant's goals as the benches print theirs."""
    def num(x, fmt: str) -> str:
        return "—" if x is None else format(x, fmt)
    table = Table(title=title, caption=caption)
    for col in ("variant", "none", "wait", "speculate", "wait/none", "spec/none", "spec/wait", "rollback wait",
                "rollback spec", "clipped wait", "clipped spec", "grad norm med."):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for r in rows:
        ms, ratios, back, clipped = r["step_ms"], r["ratios"], r["rollback_rate"], r["clipped_rate"]
        table.add_row(r["variant"], *(num(ms.get(m), ".1f") for m in MODES),
                      *(num(ratios.get(k), ".3f") for k in ("wait_over_none", "speculate_over_none",
                                                            "speculate_over_wait")),
                      *(num(back.get(m), ".2f") for m in ("wait", "speculate")),
                      *(num(clipped.get(m), ".2f") for m in ("wait", "speculate")), num(r["grad_norm_median"], ".3g"))
    console.print(table)
    for r in rows:
        if r["meets_goals"]:
            console.print(f"{r['variant']}: goals: " + ", ".join(
                f"{k} {'met' if v else 'MISSED'}" if v is not None else f"{k} not judged ({r['not_judged'][k]})"
                for k, v in r["meets_goals"].items()))
