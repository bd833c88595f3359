"""The GPU path, proven on the CPU: which device a run picks and why, the refusals that come before
any worker starts, a refusal inside a worker that ends the run at once, and a GPU's own figures
(a stub probe with CUDA-style numbers) carried through the step exchange into the telemetry log."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import jsonschema
import pytest

from engine.runtime import devices
from engine.config import load_config
from engine.runtime.control import GPU_FIELDS, rank_rows, row_values
from engine.runtime.devices import LedgerDevice, choose_device
from engine.run.checks import RunSetupError, check_machine
from engine.runtime.refusal import Refused
from engine.telemetry.schema import RECORD_SCHEMA
from engine.run.rank import Job
from tests.conftest import ROOT, pid_alive, read_jsonl

DEMO = str(ROOT / "demo" / "configs" / "digits_ddp.toml")
GiB = 2**30


class StubProbe:
    """A GPU's figures as CudaProbe gives them, made up and different per rank; the device stays the CPU."""

    def __init__(self, rank: int):
        self.rank = rank

    def name(self) -> str:
        return f"Stub GPU {self.rank} (CPU test)"

    def total_bytes(self) -> int:
        return 80 * GiB

    def figures(self) -> dict:
        return stub_figures(self.rank)

    def gauges(self) -> dict:   # NVML's, read at most every OS_SAMPLE_S: the stub gives them with the rest
        return {}


def stub_figures(rank: int) -> dict:
    return {"allocated_bytes": 3 * GiB + rank, "reserved_bytes": 4 * GiB + rank,
            "allocator_peak_bytes": 5 * GiB + rank, "nvml_used_bytes": 6 * GiB + rank,
            "nvml_total_bytes": 80 * GiB, "gpu_util_percent": 40 + rank}


def open_stub_device(kind, capacity_bytes, local_rank, local_world_size):
    device = LedgerDevice(capacity_bytes, probe=StubProbe(local_rank))
    device.note = "stub: a CPU device whose probe reports CUDA-style figures (tests)"
    return device


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this host has `n` CUDA devices (for the choice of device only; nothing runs on them)."""
    def visible(n: int):
        monkeypatch.setattr(devices, "cuda_count", lambda: n)
        monkeypatch.setattr("engine.run.checks.cuda_count", lambda: n)
    return visible


# --- which device, and why -----------------------------------------------------------------------

def test_auto_takes_one_gpu_per_worker_and_says_so(gpus):
    gpus(2)
    assert choose_device("auto", 2) == ("cuda", "cuda: one GPU per worker (2 visible for 2 workers on this host)")


def test_auto_with_fewer_gpus_than_workers_trains_on_the_cpu_and_says_why(gpus):
    gpus(1)
    kind, note = choose_device("auto", 2)
    assert kind == "cpu"
    assert note == ('cpu: device.kind = "auto" but 1 CUDA device is visible for 2 workers on this host, so every '
                    'worker trains on the CPU (simulated devices); parallel.world_size = 1 per host would train '
                    'on the GPUs')


def test_cuda_with_too_few_gpus_is_refused_naming_both_counts(gpus):
    gpus(1)
    with pytest.raises(Refused, match=r'device.kind = "cuda" but 1 CUDA device is visible for 2 workers on this '
                                      r'host \(one GPU per worker\): set parallel.world_size to at most 1 per host'):
        choose_device("cuda", 2)


def test_the_launcher_refuses_cuda_without_gpus_before_anything_starts(gpus, tmp_path):
    gpus(1)
    cfg = load_config(DEMO, ["device.kind=cuda", f"run.dir={tmp_path}"])
    with pytest.raises(RunSetupError, match="1 CUDA device is visible for 2 workers"):
        check_machine(Job(config=cfg))
    assert not (tmp_path / cfg.run.name).exists()


def test_the_launcher_says_in_one_line_when_auto_leaves_gpus_unused(gpus, capsys):
    gpus(1)
    check_machine(Job(config=load_config(DEMO, [])))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith('trainyard: cpu: device.kind = "auto" but 1 CUDA device')


def test_without_gpus_auto_says_nothing(gpus, capsys):
    gpus(0)
    check_machine(Job(config=load_config(DEMO, [])))
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("overrides, words", [
    (["update.placement=auto", "device.memory=100KiB"],
     'update.placement = "auto" plans against it) is below the smallest capacity this run fits: every rank '
     'holds 102.0 KiB of parameters and as much of gradients, whatever the memory and update plans; set '
     'device.memory to at least 204.1 KiB (208976 bytes)'),
    (["memory.policy=auto", "parallel.strategy=pipeline", "parallel.pipeline.micro_batches=2", "device.memory=10KiB"],
     'memory.policy = "auto" plans against it) is below the smallest capacity this run fits: the largest '
     'pipeline stage holds'),
    # a range of hosts: the fewest hosts run the fewest stages, each holding the most
    (["memory.policy=auto", "parallel.strategy=pipeline", "parallel.pipeline.micro_batches=2", "device.memory=10KiB",
      "parallel.world_size=4", "cluster.nnodes=4", "cluster.min_nnodes=2", "cluster.rdzv_endpoint=10.0.0.1:29400"],
     'memory.policy = "auto" plans against it) is below the smallest capacity this run fits: with 2 of 4 hosts '
     '(2 stages) the largest pipeline stage holds'),
])
def test_a_capacity_a_plan_cannot_fit_is_refused_before_launch(overrides, words, tmp_path):
    cfg = load_config(DEMO, [*overrides, f"run.dir={tmp_path}"])
    with pytest.raises(RunSetupError) as e:
        check_machine(Job(config=cfg))
    assert words in str(e.value) and "set device.memory to at least" in str(e.value)


def test_a_pipeline_of_more_stages_than_clusters_is_refused_before_launch():
    cfg = load_config(DEMO, ["memory.policy=auto", "parallel.strategy=pipeline", "parallel.pipeline.micro_batches=2",
                             "device.memory=10KiB", "parallel.world_size=64", "data.batch_size=64"])
    with pytest.raises(RunSetupError, match=r"parallel.pipeline: cannot split 5 clusters into 64 stages"):
        check_machine(Job(config=cfg))


def test_on_a_gpu_the_capacity_binds_without_a_plan(gpus):
    gpus(2)
    with pytest.raises(RunSetupError, match=r"\(1.0 KiB; on a GPU it is a hard limit\) is below the smallest"):
        check_machine(Job(config=load_config(DEMO, ["device.memory=1KiB"])))


def test_on_the_cpu_a_capacity_without_a_plan_is_only_reported_when_exceeded(gpus):
    gpus(0)   # the simulated ledger: going over is reported at run time (test_telemetry_log), not refused
    check_machine(Job(config=load_config(DEMO, ["device.memory=1KiB"])))


def test_a_capacity_that_holds_parameters_and_gradients_passes():
    check_machine(Job(config=load_config(DEMO, ["update.placement=auto", "device.memory=250KiB"])))


# --- the device's own figures ------------------------------------------------------------------

def test_a_probe_adds_the_gpus_figures_and_sizes_an_auto_capacity():
    device = LedgerDevice(None, probe=StubProbe(1))
    stats = device.stats()
    assert {k: stats[k] for k in GPU_FIELDS} == stub_figures(1)
    assert stats["capacity_bytes"] == 80 * GiB and device.name == "Stub GPU 1 (CPU test)"
    assert LedgerDevice(None).ledger.capacity_bytes == devices.SIMULATED_CAPACITY_BYTES
    assert LedgerDevice(GiB, probe=StubProbe(0)).ledger.capacity_bytes == GiB   # a size caps it


def test_the_exchange_row_leaves_out_gpu_figures_a_rank_does_not_have():
    import torch
    cpu, gpu = LedgerDevice(1 << 20).stats(), LedgerDevice(1 << 20, probe=StubProbe(1)).stats()
    rows = rank_rows(torch.tensor([row_values(cpu), row_values(gpu)], dtype=torch.float64))
    assert not set(GPU_FIELDS) & set(rows[0])
    assert {k: rows[1][k] for k in GPU_FIELDS} == stub_figures(1)


# --- whole runs ----------------------------------------------------------------------------------

def launch_script(tmp_path, overrides: list[str], stub: bool) -> subprocess.CompletedProcess:
    """`launch(Job(...))` in a process session of its own (reaped whatever happens), as `trainyard run`
    does it, with the stub device when `stub`."""
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(ROOT / 'tests')!r})
        from engine.config import load_config
        from engine.run.launch import RunSetupError, launch, prepare_run_dir
        from engine.run.rank import Job
        from test_gpu import open_stub_device
        cfg = load_config({DEMO!r}, {overrides!r})
        job = Job(config=cfg, open_device=open_stub_device if {stub!r} else None)
        try:
            prepare_run_dir(job)
            summary = launch(job)
        except RunSetupError as e:
            print(f"{{type(e).__name__}}: {{e}}", file=sys.stderr)
            sys.exit(2)
        print(json.dumps(summary))
    """)
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))   # and where deps were put
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, "COLUMNS": "200",
           "TRAINYARD_RUNTIME_DIR": str(tmp_path / "rt")}
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the run did not finish in 90 s\n{out}\n{err}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.timeout(120)
def test_a_gpus_figures_reach_the_log_by_rank(tmp_path):
    # every step with full rank rows (rank_every=1): the GPU's own figures, exact, in each
    r = launch_script(tmp_path, [f"run.dir={tmp_path}", "run.steps=4", "checkpoint.every=0",
                                 "run.eval_every=0", "telemetry.rank_every=1"], stub=True)
    assert r.returncode == 0, r.stderr
    records = read_jsonl(tmp_path / "digits-ddp" / "telemetry.jsonl")
    validator = jsonschema.Draft202012Validator(RECORD_SCHEMA)
    for record in records:
        validator.validate(record)
    start = records[0]
    assert start["devices"] == ["Stub GPU 0 (CPU test)", "Stub GPU 1 (CPU test)"]
    assert start["device"] == "Stub GPU 0 (CPU test)" and start["device_note"].startswith("stub:")
    steps = [rec for rec in records if rec["type"] == "step"]
    assert len(steps) == 4
    for step in steps:
        for entry in step["ranks"]:
            assert {k: entry[k] for k in GPU_FIELDS} == stub_figures(entry["rank"])
            assert entry["capacity_bytes"] == 1 << 20   # the demo config's device.memory caps the GPU
    summary = records[-1]
    assert summary["type"] == "summary"
    assert summary["allocator_peak_bytes_per_rank"] == [stub_figures(0)["allocator_peak_bytes"],
                                                        stub_figures(1)["allocator_peak_bytes"]]
    assert "GPU allocator peak 5.0 GiB" in r.stdout   # the headless summary table


@pytest.mark.timeout(120)
def test_a_refusal_inside_a_worker_ends_the_run_at_once_without_a_restart(tmp_path):
    # parameters and gradients fit 250 KiB, so the launcher lets it start; the update plan, made by
    # every worker after its trial steps, needs the activations too and cannot fit
    r = launch_script(tmp_path, [f"run.dir={tmp_path}", "run.steps=12", "parallel.strategy=sharded",
                                 "update.placement=auto", "device.memory=250KiB", "parallel.max_restarts=3"],
                      stub=False)
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("RunRefused")]
    assert len(lines) == 1 and "is too small for the update plan" in lines[0], r.stderr
    assert "the smallest capacity that fits is" in lines[0]
    assert "restarting" not in r.stderr
    pids = [int(p.read_text()) for p in (tmp_path / "digits-ddp" / "pids").glob("rank*.pid")]
    assert pids and not any(pid_alive(pid) for pid in pids)
