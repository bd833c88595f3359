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
from engine.config.settings import Config, ConfigError, config_to_toml


def markdown_reference() -> str:
    """docs/config.md: how to write a config, then one table per section, from the declarations above."""
    out = [_INTRO]
    for section in dataclasses.fields(Config):
        cls = section.default_factory
        out += [f"## [{section.name}]", "", cls.__doc__, "",
                "| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            path = f"{section.name}.{f.name}"
            allowed = allowed_words(path, f) or {"bool": "true or false"}.get(str(f.type), "any text")
            default = getattr(cls(), f.name)
            row = [f"`{f.name}`", f.metadata["kind"] or str(f.type), f"`{show(default)}`", allowed,
                   f.metadata["doc"]]
            out.append("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |")
        out.append("")
    out += ["## Rules across keys", "", "Checked after every key is valid on its own:", ""]
    out += ["- " + " ".join(check.__doc__.split()) for check in CROSS_CHECKS]
    return "\n".join(out) + "\n"


_INTRO = """\
# Configuration reference

<!-- Generated from engine/config/settings.py by `python -m engine.config --markdown > docs/config.md`;
     edit the declarations there, not this file (tests/test_config.py checks they agree). -->

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
`--set section.key=value` (repeatable, applied over the file). The value is read as a
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
        sys.stdout.write(config_to_toml(load_config(args.config, args.overrides)))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return 0
