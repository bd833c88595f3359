"""A pipeline stage's messages to its neighbours (technique 4): activations forward (tag 0) and their gradients
backward (tag 1), each the first of its kind in a step preceded by a header (HEADER_LEN int64s: ndim, the
shape, the dtype's code), non-blocking sends kept alive until the step's end, receives that say who went silent.
PipelineStage's collaborator (stage.py: the module's docstring says why this ordering cannot deadlock).

Each receive of the step's schedule is posted one ahead (`irecv`): as the stage takes a message, the next one it
will take is posted, so it lands while the stage computes, where a receive posted only when its op starts
waited for the message's transfer every micro-batch (0.17 ms each on this CPU's loopback, as long as the
stage's own forward of a micro-batch at `bench pipeline`'s size). Posting a receive early cannot deadlock: it
only gives its message somewhere to land. A message whose shape the step has not been told yet is its header.

Imports engine.training.precision (dtype codes).
"""

from __future__ import annotations

import time
from collections import deque

import torch
import torch.distributed as dist

from engine.training.precision import DTYPES, dtype_code

HEADER_LEN = 8
FWD_TAG, BWD_TAG = 0, 1


class StageWire:
    """A stage's link to its neighbours on `group`: it owns the step's sends in flight (each with the tensor it
    reads, kept alive until `finish`), the shapes told so far, the payload bytes sent and the time waited.

        wire.begin_step(move, ops, prev, next)   # before the step's first message (move: a migration, or None;
                                                 # ops: the step's schedule, schedule.py; the neighbours' ranks)
        wire.send(out, next_rank, FWD_TAG, new_layout); grad = wire.recv(next_rank, BWD_TAG, new_layout)
        wire.finish()                            # the step's end: every send in flight waited on
    """

    def __init__(self, group, rank: int, torch_device: torch.device):
        self.group, self.rank = group, rank
        self.torch_device = torch_device   # gloo sends CPU tensors, nccl device tensors: the stage's own device
        self.pending: list = []   # (work, tensor) of the step's sends, and the ties' (tied.py), until `finish`
        self.shapes: dict = {}    # (direction, tag, layout) -> what its first message said
        self.sent_bytes = 0       # payload bytes sent to the neighbours in the step (activations, gradients)
        self.recv_s = 0.0         # the step's seconds blocked in a receive
        self.moving = None        # the step's migration: a receive that fails names its layers
        self.expected: deque = deque()   # the step's receives still to take, in order: (src, tag, layout)
        self.posted = None        # (work, tensor, is_header) of the first of them, posted ahead

    def begin_step(self, moving=None, ops=(), prev: int | None = None, next_: int | None = None) -> None:
        self.pending, self.shapes, self.sent_bytes, self.recv_s, self.moving = [], {}, 0, 0.0, moving
        self.expected = deque((prev, FWD_TAG, moving is not None and moving.use_new(i)) if op == "F" else
                              (next_, BWD_TAG, moving is not None and moving.use_new(i))
                              for op, i in ops if (prev if op == "F" else next_) is not None)
        self.posted = None
        self._post()

    def _post(self) -> None:
        """The next receive of the schedule posted: its payload where its shape is known, else its header."""
        if self.posted is not None or not self.expected:
            return
        src, tag, layout = self.expected[0]
        kind = self.shapes.get(("from", tag, layout))
        dev = self.torch_device
        into = torch.empty(HEADER_LEN, dtype=torch.int64, device=dev) if kind is None else \
            torch.empty(kind[0], dtype=kind[1], device=dev)
        self.posted = (dist.irecv(into, src, group=self.group, tag=tag), into, kind is None)

    def send(self, tensor: torch.Tensor, dst: int, tag: int, layout: int = 0) -> None:
        dev = self.torch_device
        # in its own dtype: bf16 activations and gradients under `precision.compute = "bf16"`, half the bytes
        tensor = tensor.detach().to(dev).contiguous()
        if tensor.dim() > HEADER_LEN - 2:
            raise ValueError(f"pipeline messages carry at most {HEADER_LEN - 2} dimensions, got {tensor.dim()}")
        sends = [tensor]
        self.sent_bytes += tensor.numel() * tensor.element_size()   # the boundary's payload, in its dtype
        if ("to", tag, layout) not in self.shapes:   # the first message of its kind this step: shape and dtype
            self.shapes[("to", tag, layout)] = tuple(tensor.shape)
            header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=dev)
            header[0] = tensor.dim()
            header[1:1 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
            header[-1] = dtype_code(tensor.dtype)
            sends.insert(0, header)
        for t in sends:   # keep the tensor alive until its send is waited on
            self.pending.append((dist.isend(t, dst, group=self.group, tag=tag), t))

    def recv(self, src: int, tag: int, layout: int = 0) -> torch.Tensor:
        """The schedule's next message (begin_step's `ops`), from `src` on `tag`; the one after it posted."""
        if not self.expected or self.expected[0] != (src, tag, layout):
            raise RuntimeError(f"pipeline stage {self.rank}: a receive from rank {src} on tag {tag} (layout {layout}) "
                               f"is not the schedule's next, {self.expected[0] if self.expected else 'none'}")
        t0 = time.perf_counter()
        try:
            work, out, is_header = self.posted
            self.posted = None
            work.wait()
            if is_header:
                self.shapes[("from", tag, layout)] = (tuple(int(d) for d in out[1:1 + int(out[0])].tolist()),
                                                      DTYPES[int(out[-1])])
                self._post()   # the payload, by the header's shape
                work, out, _ = self.posted
                self.posted = None
                work.wait()
        except Exception as e:   # a neighbour died or went silent: say who and what, within the timeout
            what = "activations" if tag == FWD_TAG else "gradients"
            during = (f" while layers migrate ({', '.join(n for n, _, _ in self.moving.moves)})"
                      if self.moving is not None else "")
            raise RuntimeError(f"pipeline stage {self.rank}: receiving {what} from stage "
                               f"{dist.get_group_rank(self.group, src)} failed{during}: {type(e).__name__}: {e}") from e
        # waiting for a neighbour, the stage's idle time: host time, as the host blocks in the receive (gloo;
        # with NCCL the host does not, and the stream's wait falls before the op's first mark, in no op's time)
        self.recv_s += time.perf_counter() - t0
        self.expected.popleft()
        self._post()
        return out

    def finish(self) -> None:
        """Every send of the step waited on; their tensors may go."""
        for work, _ in self.pending:
            work.wait()
        self.pending = []
