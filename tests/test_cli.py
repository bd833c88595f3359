"""The command line: bad configs end with exit 2 and one clear line, before any process starts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

DEMO = str(ROOT / "demo" / "configs" / "digits_ddp.toml")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args,words", [
    (["--set", "optim.lrr=0.1"], ["optim.lrr", "did you mean 'optim.lr'", "allowed keys"]),
    (["--set", "data.batch_size=\"many\""], ["data.batch_size", '"many"', "integer"]),
    (["--set", "parallel.world_size=0"], ["parallel.world_size", "0", "between 1 and 256"]),
    (["--set", "optim.name=adam"], ["optim.name", '"adam"', '"sgd", "adamw"']),
    (["--set", "parallel.strategy=param_server", "--set", "parallel.param_server.workers=3"],
     ["parallel.param_server.servers = 1 + parallel.param_server.workers = 3", "parallel.world_size = 2"]),
    (["--steps", "0"], ["run.steps", "0", ">= 1"]),
])
def test_bad_config_values_exit_2_naming_key_value_and_allowed(cli, args, words):
    r = cli.run("run", DEMO, "--headless", *cli.base_args("bad"), *args, timeout=40)
    assert r.returncode == 2
    assert r.stderr.startswith("config error: ")
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr   # one line, no traceback
    for word in words:
        assert word in r.stderr
    assert not (cli.tmp_path / "runs" / "bad").exists()        # nothing was started


@pytest.mark.timeout(60)
def test_missing_config_file(cli):
    r = cli.run("run", str(cli.tmp_path / "nope.toml"), "--headless", timeout=40)
    assert r.returncode == 2
    assert "config file not found" in r.stderr and "nope.toml" in r.stderr


@pytest.mark.timeout(60)
def test_unknown_key_in_the_file(cli):
    bad = cli.tmp_path / "bad.toml"
    bad.write_text("[run]\nsteps = 5\nstpes = 6\n")
    r = cli.run("run", str(bad), "--headless", timeout=40)
    assert r.returncode == 2
    assert "unknown key 'run.stpes' (did you mean 'run.steps'?)" in r.stderr


@pytest.mark.parametrize("args", [("demo",), ("console",), ("runs",), ("ctl", "somerun", "pause")])
def test_a_runtime_folder_others_can_read_is_refused_by_name(cli, runtime_dir, args):
    runtime_dir.chmod(0o755)
    r = cli.run(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert f"{runtime_dir}: must belong to you and be private (mode 0700)" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.timeout(60)
def test_a_command_leaves_its_objects_out_of_the_last_collection_at_exit_only(cli):
    """engine/processes/ending.py: a command (here `trainyard runs`, twice) freezes every object only at its
    process's exit, after the atexit handlers registered after it, so the interpreter's last collection does not
    walk them all; the process that called it goes on collecting until then."""
    code = ("import atexit, gc; from engine.cli import main\n"
            "atexit.register(lambda: print('last', gc.get_freeze_count() > 0))\n"   # runs after the freeze
            "print('ran', main(['runs']), main(['runs']), gc.get_freeze_count())\n"
            "atexit.register(lambda: print('first', gc.get_freeze_count()))\n")     # runs before it
    ran = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=50,
                         env={**os.environ, "TRAINYARD_RUNTIME_DIR": str(cli.runtime_dir)})
    said = [line for line in ran.stdout.splitlines() if line.split()[0] in ("ran", "first", "last")]
    assert ran.returncode == 0 and said == ["ran 0 0 0", "first 0", "last True"], ran.stdout + ran.stderr
