"""The `trainyard` command.

    trainyard run CONFIG.toml [--headless] [--steps N] [--set section.key=value ...]
                  [--telemetry-log PATH] [--resume CHECKPOINT_OR_RUN_DIR]
                  [--nnodes N|MIN:MAX --node-rank R --rdzv-endpoint HOST:PORT] [--interface IFNAME]
    trainyard demo [NAME] [--steps N] [--headless]      NAME: tour (default), pipeline, memory, sharded, hybrid, ps, ddp
    trainyard console [RUN] [--read-only] [--replay LOG] [--token-file F]
    trainyard runs
    trainyard export RUN DIR [--step N] [--dtype fp32|bf16] [--overwrite]
    trainyard prepare SRC... --tokenizer DIR --out DIR [--field text] [--val-fraction F] [--workers N]
                      [--eos TOKEN] [--text-unit paragraph|line|document]
    trainyard ctl RUN COMMAND [ARGS ...]
    trainyard bench NAME [--json]
    trainyard plan CONFIG.toml --hosts N --per-host G [--memory SIZE] [--set KEY=VALUE ...] [--json]
    trainyard cluster up --hosts 2 --link 1gbit | exec HOST -- COMMAND | status | down

Exit status: 0 done; 1 the run failed (workers died more often than
parallel.max_restarts allows, an error that would recur on a restart, a full disk);
2 a bad config, command line or checkpoint, or a live run's name (nothing was
started); 128+N stopped by signal N after the final checkpoint.
`ctl`: 0 applied, 1 rejected, 2 a bad command or no such run.
`export`: 0 written; 2 refused (DIR exists, no such run or step, a damaged checkpoint; docs/checkpoints.md).
`prepare`: 0 written; 1 a write failed (a full disk); 2 refused (a source, the tokenizer or a flag named; docs/data.md).
`demo` starts its run (demo/__init__.py says which config and what to press) in the background and
opens the console on it (demo/launch.py); `demo --headless` trains in the foreground with a
progress bar, as `run --headless` does. A demo run is named demo-NAME and overwrites its previous
run, unless that one is still training: then demo-NAME-2, and so on.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape

err = Console(stderr=True, highlight=False, soft_wrap=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainyard", description="Distributed training with a live console.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="train from a TOML config")
    run.add_argument("config", help="TOML config file (see docs/config.md)")
    run.add_argument("--headless", action="store_true", help="progress bar and log file, no console")
    run.add_argument("--steps", type=int, help="override run.steps")
    run.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE",
                     help="override a config key, e.g. --set optim.lr=0.1 (repeatable)")
    run.add_argument("--telemetry-log", type=Path, help="JSON-lines telemetry log (docs/telemetry.md)")
    run.add_argument("--resume", type=Path, metavar="DIR",
                     help="a checkpoint folder, or a run directory (its latest checkpoint)")
    run.add_argument("--listen", metavar="tcp://127.0.0.1:PORT",
                     help="also serve consoles on loopback TCP (token in the run's token file)")
    hosts = run.add_argument_group("several hosts (docs/cluster.md): one `trainyard run` per host")
    hosts.add_argument("--nnodes", type=_host_range, metavar="N|MIN:MAX",
                       help="hosts in the run (cluster.nnodes); MIN:MAX: the fewest it may go on with too "
                            "(cluster.min_nnodes)")
    hosts.add_argument("--node-rank", type=int, metavar="R", help="this host's number, 0 to N-1 (cluster.node_rank)")
    hosts.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                       help="host 0's address and a free port, the same on every host (cluster.rdzv_endpoint)")
    hosts.add_argument("--interface", metavar="IFNAME", help="network interface for collectives (cluster.interface)")

    from demo import DEFAULT, DEMOS
    demo = sub.add_parser("demo", help="run a ready-made demo", formatter_class=argparse.RawDescriptionHelpFormatter,
                          description="Start a demo run and open the console on it. The demos:\n" +
                          "\n".join(f"  {name:9} {d.about}\n  {'':9} keys: {d.keys}" for name, d in DEMOS.items()))
    demo.add_argument("name", nargs="?", default=DEFAULT, choices=list(DEMOS),
                      help=f"which demo (default: {DEFAULT})")
    demo.add_argument("--steps", type=int, help="override run.steps")
    demo.add_argument("--headless", action="store_true",
                      help="train in the foreground with a progress bar (no console)")

    console = sub.add_parser("console", help="the live console: attach to a run, or replay a telemetry log")
    console.add_argument("run", nargs="?", help="run name, socket path or tcp://127.0.0.1:PORT "
                                                "(default: the only live run, or a picker)")
    console.add_argument("--read-only", action="store_true", help="watch only: commands are disabled")
    console.add_argument("--replay", type=Path, metavar="LOG", help="play a telemetry log back (space, n, +, -)")
    console.add_argument("--token-file", type=Path, help="token file of a TCP hub")

    sub.add_parser("runs", help="list the live runs on this machine")

    export = sub.add_parser("export", help="write a run's model out: a Hugging Face save_pretrained folder",
                            description="Write a run's model from one of its checkpoints: a Hugging Face model as "
                                        "a save_pretrained folder, any other LayerList as model.safetensors "
                                        "(docs/checkpoints.md).")
    export.add_argument("run", metavar="RUN", help="a run folder (runs/NAME), or a run's name under runs/")
    export.add_argument("dir", metavar="DIR", type=Path,
                        help="the folder to write; refused if it exists, unless --overwrite")
    export.add_argument("--step", type=int, metavar="N", help="the checkpoint of step N (default: the latest)")
    export.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                        help="the weights' type (default: fp32, the checkpoint's own)")
    export.add_argument("--overwrite", action="store_true",
                        help="replace DIR, once the new folder is whole")

    _prepare_parser(sub)

    cluster = sub.add_parser("cluster", help="an emulated cluster on this machine: network namespaces, shaped links "
                                             "(root)", add_help=False)
    cluster.add_argument("cluster_args", nargs=argparse.REMAINDER, help="up | exec | status | down (see --help)")

    plan = sub.add_parser("plan", help="the layouts that fit N hosts x G devices, and each rank's memory, on paper",
                          description="For the config's model (on the meta device: no worker, no data file read), "
                                      "every layout of N x G devices and the memory its tightest rank holds "
                                      "(docs/plan.md). Exit status 2 when none fits.")
    plan.add_argument("config", help="TOML config file (see docs/config.md)")
    plan.add_argument("--hosts", type=int, required=True, metavar="N", help="hosts")
    plan.add_argument("--per-host", type=int, required=True, metavar="G", help="devices (ranks) on each host")
    plan.add_argument("--memory", metavar="SIZE", help="each device's capacity, e.g. 80GB (default: device.memory)")
    plan.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE",
                      help="override a config key, e.g. --set data.seq_len=4096 (repeatable)")
    plan.add_argument("--json", action="store_true", help="the table as JSON (docs/plan.md names the fields)")

    bench = sub.add_parser("bench", help="run a benchmark (its variants side by side, ratios printed)")
    bench.add_argument("name", choices=_benches())
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="--json, and the bench's own options")

    ctl = sub.add_parser("ctl", help="send one command to a live run",
                         description="Commands: " + "; ".join(_usages()))
    ctl.add_argument("run", help="run name, socket path, or tcp://127.0.0.1:PORT")
    ctl.add_argument("ctl_command", metavar="COMMAND")
    ctl.add_argument("args", nargs="*", metavar="ARG")
    ctl.add_argument("--token-file", type=Path, help="token file of a TCP hub")
    ctl.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the reply")
    return parser


def _prepare_parser(sub) -> None:
    from engine.prepare import TEXT_UNITS, VAL_FRACTION
    prepare = sub.add_parser("prepare", help="text to token files (train.bin, val.bin, meta.json) with a tokenizer",
                             description="Tokenize local text, JSON-lines or Parquet files with a tokenizer folder "
                                         "into the token files `[data] name = \"tokens\"` reads (docs/data.md).")
    prepare.add_argument("sources", nargs="+", metavar="SRC",
                         help="a .txt, .jsonl, .json or .parquet file, or a folder of them")
    prepare.add_argument("--tokenizer", required=True, metavar="DIR",
                         help="a tokenizer folder (save_pretrained's; the model's own, or trainyard export's)")
    prepare.add_argument("--out", required=True, metavar="DIR", help="the folder to write the files into")
    prepare.add_argument("--field", default="text", help="JSON-lines and Parquet: the text field (default: text)")
    prepare.add_argument("--val-fraction", type=float, default=VAL_FRACTION, metavar="F",
                         help=f"share of the documents for val.bin, at least one (default: {VAL_FRACTION}); 0: none")
    prepare.add_argument("--workers", type=int, default=1, metavar="N", help="tokenizing processes (default: 1)")
    prepare.add_argument("--eos", metavar="TOKEN",
                         help="the token after each document (default: the tokenizer's eos_token)")
    prepare.add_argument("--text-unit", choices=TEXT_UNITS, default="paragraph",
                         help=".txt files: one document per paragraph (blank-line separated; default), line, or file")


def _benches() -> list[str]:
    from engine.bench import BENCHES
    return list(BENCHES)


def _usages() -> list[str]:
    from engine.telemetry.protocol import COMMANDS, usage
    return [usage(name) for name in COMMANDS]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from engine.processes.ending import skip_final_collection_at_exit
    skip_final_collection_at_exit()   # this process's exit will not walk torch's objects once more
    if argv[:1] == ["cluster"]:   # its own parser, `--help` included
        from engine.processes import cluster
        return cluster.main(argv[1:])
    args = _parser().parse_args(argv)
    from engine.processes.children import torch_cache_out_of_temp
    from engine.telemetry.protocol import RuntimeDirError
    torch_cache_out_of_temp()
    try:
        return _dispatch(args)
    except RuntimeDirError as e:   # where live runs are registered: the demo, console, runs and ctl need it
        err.print(f"[red]error:[/] {escape(str(e))}")
        return 2


def _dispatch(args) -> int:
    if args.command == "bench":
        from engine import bench
        return bench.run(args.name, args.bench_args)
    if args.command in ("runs", "ctl"):
        from engine import ctl
        if args.command == "runs":
            return ctl.runs()
        return ctl.ctl(args.run, args.ctl_command, args.args, args.token_file, args.timeout)
    if args.command == "export":
        return _export(args)
    if args.command == "plan":
        return _plan(args)
    if args.command == "prepare":
        return _prepare(args)
    if args.command == "console":
        from console.__main__ import attach
        return attach(args.run, args.read_only, args.replay, args.token_file)
    if args.command == "demo":
        from demo import DEMOS
        if not args.headless and sys.stdout.isatty():
            from demo.launch import demo
            return demo(args.name, args.steps)
        if not args.headless:
            err.print("note: not a terminal, so no console; running the demo headless")
        demo = DEMOS[args.name]
        from demo.launch import demo_overrides
        return _run(demo.path, demo_overrides(args.name), args.steps, None, None, headless=True)
    if not args.headless:
        err.print("note: running headless; watch the run live with `trainyard console` in another terminal")
    overrides = args.overrides + ([f"telemetry.listen={args.listen}"] if args.listen else [])
    if args.nnodes is not None:
        low, args.nnodes = args.nnodes
        overrides.append(f"cluster.min_nnodes={low}")
    for flag, key in (("nnodes", "nnodes"), ("node_rank", "node_rank"), ("rdzv_endpoint", "rdzv_endpoint"),
                      ("interface", "interface")):
        if getattr(args, flag) is not None:
            overrides.append(f"cluster.{key}={getattr(args, flag)}")
    return _run(Path(args.config), overrides, args.steps, args.telemetry_log, args.resume, headless=True)


def _host_range(text: str) -> tuple[int, int]:
    """`--nnodes N` (one size: min_nnodes 0) or `MIN:MAX`."""
    low, colon, high = text.partition(":")
    try:
        values = (int(low), int(high)) if colon else (0, int(low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a host count N or a range MIN:MAX, e.g. 2:4") from None
    if colon and not 1 <= values[0] <= values[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: MIN must be at least 1 and at most MAX")
    return values


def _run(config: Path, overrides: list[str], steps: int | None, telemetry_log: Path | None,
         resume: Path | None, headless: bool) -> int:
    # Imports here keep `trainyard --help` fast and config errors free of torch start-up time.
    from engine.config import ConfigError, load_config

    if steps is not None:
        overrides = [*overrides, f"run.steps={steps}"]
    try:
        cfg = load_config(config, overrides)
        if cfg.model.name == "user":
            raise ConfigError('model.name = "user": names the model given to engine.train in Python; a config '
                              'file names a built-in model or "hf"')
    except ConfigError as e:
        err.print(f"[red]config error:[/] {escape(str(e))}")
        return 2
    for line in cfg.renamed:   # a key written by its old name: one line each, the run goes on
        err.print(f"trainyard: {escape(line)}")

    from engine.processes.lifeline import mark_run
    from engine.run.claim import Claim, RunSetupError
    try:   # before torch loads: a live run's name is refused at once
        claim = Claim.take(cfg.run_dir, cfg.cluster.node_rank, cfg.run.name)
    except (RunSetupError, OSError) as e:   # OSError: its folder on a full or read-only disk
        return _said(e, cfg.run_dir)
    mark_run(cfg.run_dir)   # in every process of the run's environment, the fork server's included
    if cfg.device.kind != "cuda":   # the workers' fork server imports torch while this process does
        from engine.processes import forkserver
        from engine.run import PRELOAD
        forkserver.start([PRELOAD, *forkserver.config_modules(cfg)])
    from engine.runtime.checkpoint import CheckpointError
    from engine.run.launch import RunFailed, RunInterrupted, launch, prepare_run_dir
    from engine.run.rank import Job

    job = Job(config=cfg, resume=resume, telemetry_log=telemetry_log, headless=headless, claim=claim)
    try:
        prepare_run_dir(job)
    except (CheckpointError, RunSetupError, OSError) as e:
        if not isinstance(e, OSError):
            claim.abandon()   # refused before it started: a folder made for it goes
        return _said(e, cfg.run_dir)
    try:
        launch(job)
    except (CheckpointError, RunSetupError, RunFailed, OSError) as e:   # OSError: the launcher's own writes
        return _said(e, cfg.run_dir)
    except RunInterrupted as e:
        err.print(f"[yellow]{escape(str(e))}[/]")
        return 128 + e.signum
    from engine.run.export import export_at_end
    export_at_end(cfg)   # a Hugging Face model: runs/NAME/hf/
    return 0


def _said(error: Exception, run_dir: Path) -> int:
    """A run's end by an error, in one line without a traceback; returns the exit status (1 a failure, a full
    disk; 2 a refusal)."""
    from engine.runtime.disk import describe_os_error
    if isinstance(error, OSError):
        err.print(f"[red]run failed:[/] {escape(describe_os_error(error, run_dir))}")
        return 1
    # by the classes' names: a live run's refusal is said before torch (engine.run.launch's import) loads
    label = next(_LABELS[c.__name__] for c in type(error).__mro__ if c.__name__ in _LABELS)
    err.print(f"[red]{label}:[/] {escape(str(error))}")
    return 1 if label == "run failed" else 2


_LABELS = {"RunRefused": "run refused", "RunSetupError": "cannot start", "CheckpointError": "checkpoint refused",
           "RunFailed": "run failed"}


def _plan(args) -> int:
    from engine.config import ConfigError
    from engine.plan import PlanError, plan
    try:
        return plan(Path(args.config), args.hosts, args.per_host, args.memory, args.overrides, args.json)
    except ConfigError as e:
        err.print(f"[red]config error:[/] {escape(str(e))}")
    except PlanError as e:
        err.print(f"[red]plan refused:[/] {escape(str(e))}")
    except ValueError as e:   # a model the config names that cannot be built (engine.models, models/hf)
        err.print(f"[red]model error:[/] {escape(str(e))}")
    return 2


def _prepare(args) -> int:
    from engine.prepare import PrepareError, describe, prepare
    try:
        meta = prepare(args.sources, args.tokenizer, args.out, field=args.field, val_fraction=args.val_fraction,
                       workers=args.workers, eos=args.eos, text_unit=args.text_unit)
    except PrepareError as e:
        err.print(f"[red]prepare refused:[/] {escape(str(e))}")
        return 2
    except OSError as e:   # the output folder cannot be written: a full disk, a file in the way
        from engine.runtime.disk import describe_os_error
        err.print(f"[red]prepare failed:[/] {escape(describe_os_error(e, Path(args.out)))}")
        return 1
    for line in describe(meta, args.out):
        print(line)
    return 0


def _export(args) -> int:
    from engine.run.export import ExportError, export
    from engine.runtime.checkpoint import CheckpointError
    try:
        done = export(args.run, args.dir, step=args.step, dtype=args.dtype, overwrite=args.overwrite)
    except (ExportError, CheckpointError) as e:
        err.print(f"[red]export refused:[/] {escape(str(e))}")
        return 2
    for line in done.lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
