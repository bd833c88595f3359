"""The run core (engine/runtime/run_core.py): what every run does, whichever driver hands it its commands and
records. Here with a driver that keeps what it is asked, and a telemetry that keeps what it is told; the two real
drivers run it in every run test (the step loop's in tests/test_training.py, the coordinator's in
tests/test_param_server.py)."""

from __future__ import annotations

from types import SimpleNamespace

from engine.config import config_from_dict
from engine.runtime.run_core import RunCore
from tests.conftest import Told


class Telemetry(Told):
    def __init__(self):
        super().__init__()
        self.replies, self.state, self.steps, self.summaries, self.closed = [], {}, [], [], []

    def reply(self, command, status, **fields):
        self.replies.append((command["name"], status, fields))

    def update_state(self, **state):
        self.state.update(state)

    def step(self, record):
        self.steps.append(record)

    def summary(self, summary):
        self.summaries.append(summary)

    def close(self, why):
        self.closed.append(why)


class Driver:
    def __init__(self):
        self.asked: list = []

    def checkpoint(self, step):
        self.asked.append(("checkpoint", step))

    def own_command(self, command, step):
        self.asked.append((command["name"], step))
        return {"set-sync": True, "later": None}.get(command["name"], False)

    def paused_changed(self):
        self.asked.append(("paused_changed",))

    def stopping(self):
        self.asked.append(("stopping",))


def core(strategy: str = "param_server") -> tuple[RunCore, Telemetry, Driver]:
    cfg = config_from_dict({"parallel": {"strategy": strategy, "world_size": 2}, "run": {"name": "core"}})
    tel, driver = Telemetry(), Driver()
    job = SimpleNamespace(config=cfg, launched_at=None)
    return RunCore(job, SimpleNamespace(world_size=2, is_first=True), tel, driver), tel, driver


def test_every_command_is_answered_and_the_drivers_own_go_to_it():
    run, tel, driver = core()
    for name, step in (("pause", 3), ("resume", 4), ("checkpoint", 5), ("set-sync", 6), ("later", 7),
                       ("rebalance", 8)):
        run.take({"name": name, "args": []}, step)
    assert not run.paused and tel.state == {"paused": False}
    assert driver.asked == [("paused_changed",), ("paused_changed",), ("checkpoint", 5), ("set-sync", 6),
                            ("later", 7), ("rebalance", 8)]
    assert tel.replies == [("pause", "applied", {"step": 3}), ("resume", "applied", {"step": 4}),
                           ("checkpoint", "applied", {"step": 5}), ("set-sync", "applied", {"step": 6}),
                           ("rebalance", "rejected", {"reason": "rebalance is not available in mode param_server"})]
    run.take({"name": "stop", "args": []}, 9)   # answered once the run has ended (end)
    assert run.stop_reason == "command" and driver.asked[-1] == ("stopping",) and len(tel.replies) == 5


def test_a_drivers_records_get_the_same_peaks_and_over_capacity_event_and_the_end_says_them():
    """The coordinator's records too: a parameter server's rank over its capacity is said once, as the step
    loop's is, and the summary's peaks come from the records whichever driver wrote them."""
    run, tel, _ = core()
    rows = [{"rank": 0, "peak_bytes": 10, "capacity_bytes": 100, "over_capacity": False},
            {"rank": 1, "peak_bytes": 150, "capacity_bytes": 100, "over_capacity": True}]
    for step in (1, 2):
        run.record({"step": step, "ranks": rows})
    assert [e for e in tel.events if e[0] == "memory_over_capacity"] == [
        ("memory_over_capacity", 1, {"rank": 1, "peak_bytes": 150, "capacity_bytes": 100})]
    assert [r["step"] for r in tel.steps] == [1, 2] and len(tel.notes) == 1
    run.take({"name": "stop", "args": []}, 2)
    evaluated = {"test_accuracy": None, "val_loss": 1.25, "perplexity": 3.49}
    summary = run.end(2, True, 0.5, evaluated, {"restarts": 0})
    assert summary["peak_bytes_per_rank"] == [10, 150] and summary["restarts"] == 0
    assert {k: summary[k] for k in evaluated} == evaluated   # the last evaluation's figures
    assert summary["stopped_early"] and summary["final_loss"] == 0.5
    assert ("stop", 2, {"reason": "command"}) in tel.events and tel.replies[-1] == ("stop", "applied", {"step": 2})
    assert tel.summaries == [summary] and tel.closed == ["run stopped"]
