"""A judged figure that holds from run to run: a ratio measured in every round, its median, its spread, and
the goal's verdict, which is "undecided" when the spread covers the goal.

    judge([0.95, 0.97, 1.02], at_most=1.0)
    # {"median": 0.97, "spread": [0.95, 1.02], "goal": "<= 1.0", "verdict": "undecided"}

A goal is met when every round meets it, missed when none does; a bench prints the verdict, never a lucky
round's figure alone. Imports nothing of the engine.
"""

from __future__ import annotations

import statistics


def judge(per_round: list[float], at_most: float | None = None, at_least: float | None = None) -> dict:
    """`per_round`'s median and spread against a goal of `at_most` or `at_least` (one of them)."""
    if (at_most is None) == (at_least is None):
        raise ValueError("judge: give one of at_most and at_least")
    lo, hi = min(per_round), max(per_round)
    if at_most is not None:
        met, missed, goal = hi <= at_most, lo > at_most, f"<= {at_most:g}"
    else:
        met, missed, goal = lo >= at_least, hi < at_least, f">= {at_least:g}"
    return {"median": round(statistics.median(per_round), 3), "spread": [round(lo, 3), round(hi, 3)], "goal": goal,
            "verdict": "met" if met else "missed" if missed else "undecided"}


def judge_ratio(num: list[float], den: list[float], at_most: float | None = None,
                at_least: float | None = None) -> dict:
    """judge() of num / den round by round: a round's two figures were measured side by side, so the drift
    that hits one hits the other."""
    if len(num) != len(den):
        raise ValueError(f"judge_ratio: {len(num)} rounds against {len(den)}")
    return judge([a / b for a, b in zip(num, den)], at_most=at_most, at_least=at_least)


def say(name: str, judged: dict) -> str:
    """One goal's line: its name, median, spread over the rounds, goal and verdict."""
    lo, hi = judged["spread"]
    return (f"{name} {judged['median']:.3f} (rounds {lo:.3f}-{hi:.3f}) {judged['goal']}: "
            f"{judged['verdict'].upper() if judged['verdict'] != 'met' else 'met'}")
