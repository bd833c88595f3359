"""The console's panels: plain-data Textual widgets that know nothing of sockets."""

from .curves import Curves
from .devices import DeviceCard, DevicesPanel, human_bytes, segment_bar
from .events import EventLog
from .layers import LayerTable
from .stages import StagesPanel
from .streams import StreamsPanel

__all__ = ["Curves", "DeviceCard", "DevicesPanel", "EventLog", "LayerTable", "StagesPanel",
           "StreamsPanel", "human_bytes", "segment_bar"]
