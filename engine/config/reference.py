"""docs/config.md, generated from the declarations, and `python -m engine.config`: check a config
without running it, or print the reference.

    python -m engine.config --markdown > docs/config.md
    python -m engine.config demo/configs/tour.toml --set run.steps=5
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from engine.config.check import CROSS_CHECKS, allowed_words, show
from engine.config.load import load_config
from engine.config.parallel import MOVED
from engine.config.settings import Config, ConfigError, config_to_toml


def markdown_reference() -> str:
    """docs/config.md: how to write a config, then one table per section (and per table inside a section:
    `[parallel.sharded]`), from the declarations, then the old names still accepted."""
    out = [_INTRO]
    for section in dataclasses.fields(Config):
        out += _table_reference(section.name, section.default_factory)
    out += ["## Rules across keys", "", "Checked after every key is valid on its own:", ""]
    out += ["- " + " ".join(check.__doc__.split()) for check in CROSS_CHECKS]
    out += ["", "## Old names", "",
            "A strategy's own keys were once written flat in `[parallel]`. Each old name is still accepted, in a "
            "file and in `--set`, and the command says its new place in one line (`parallel.streams is now "
            "parallel.sharded.streams ...`); a key set under both names is refused.", "",
            "| old name | new name |", "|---|---|"]
    out += [f"| `{section}.{key}` | `{section}.{table}.{key}` |"
            for section, keys in MOVED.items() for key, table in keys.items()]
    return "\n".join(out) + "\n"


def _table_reference(path: str, cls: type) -> list[str]:
    fields = dataclasses.fields(cls)
    rows = [f for f in fields if f.metadata["kind"] != "table"]
    out = [f"## [{path}]", "", " ".join(cls.__doc__.split()), "",
           "| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    for f in rows:
        allowed = allowed_words(f"{path}.{f.name}", f) or {"bool": "true or false"}.get(str(f.type), "any text")
        row = [f"`{f.name}`", f.metadata["kind"] or str(f.type), f"`{show(getattr(cls(), f.name))}`", allowed,
               f.metadata["doc"]]
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |")
    out.append("")
    for f in fields:
        if f.metadata["kind"] == "table":
            out += _table_reference(f"{path}.{f.name}", f.default_factory)
    return out


_INTRO = """\
# Configuration reference

<!-- Generated from engine/config/settings.py (a strategy's table: its engine/strategies/NAME/spec.py) by
     `python -m engine.config --markdown > docs/config.md`; edit the declarations there, not this file
     (tests/test_config.py checks they agree). -->

A run is described by a TOML file with one table per section below. Every key is
optional and falls back to its default, so a config holds only what differs:

```toml
[run]
name = "digits-ddp"
steps = 200

[data]
batch_size = 128

[device]
memory = "1GiB"
```

Start it with `trainyard run CONFIG`. Any key can be changed for one run with
`--set section.key=value`, or `--set section.table.key=value` for a key in a table inside a section
(`--set parallel.sharded.streams=4`); repeatable, applied over the file. The value is read as a
TOML value (`--set data.batch_size=32`, `--set optim.lr=3e-4`, `--set run.overwrite=true`);
text that is not valid TOML is taken as a string, so `--set run.name=trial` and
`--set device.memory=2GiB` need no quotes. The resolved config, defaults included, is
written into every run directory.

The whole config is checked before any worker starts. An unknown key, a value of the
wrong type or one outside what the table below allows stops the command with exit
status 2 and one line that names the key, the value and what is allowed:

```
optim.lr = "fast": expected a number (float) >= 0.0
unknown key 'optim.lrr' (did you mean 'optim.lr'?); allowed keys in [optim]: name, lr, ...
```

To check a config without running it: `python -m engine.config CONFIG [--set ...]` prints
the resolved config or the error.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.config",
                                     description="Check a trainyard config, or print the reference.")
    parser.add_argument("config", nargs="?", help="TOML file (default: all defaults)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--markdown", action="store_true", help="print docs/config.md")
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(markdown_reference())
        return 0
    try:
        cfg = load_config(args.config, args.overrides)
        for line in cfg.renamed:
            print(f"trainyard: {line}", file=sys.stderr)
        sys.stdout.write(config_to_toml(cfg))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return 0
