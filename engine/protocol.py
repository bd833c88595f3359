"""The wire protocol's public name: `from engine import protocol`, the one engine module a console
imports. The module is engine/telemetry/protocol.py; this name is the same module object."""

import sys

import engine.telemetry.protocol as _protocol

sys.modules[__name__] = _protocol
