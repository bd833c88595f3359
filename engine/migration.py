"""Live layer migration between pipeline stages, inside one training step.

    move = Migration(stage, new_stages)     # at the step's start, on every rank (after a Decision)
    move.start()                            # sources: send each leaving layer's weights and optimizer state
    move.use_new(i)                         # does micro-batch i run with the new layout?
    move.receive_state()                    # targets: before their first forward with the new layout
    move.finish()                           # after the step's last backward: partial gradients change hands

Why per micro-batch: the layout switches at micro-batch `cutover` (half the step's
micro-batches; 0 with one micro-batch). Micro-batches before it run forward *and*
backward with the old layout, the rest with the new one. Every stage still takes part
in every micro-batch, and every boundary still ships one activation forward and one
gradient back per micro-batch (the header says its shape), so the schedule, its
message order and its deadlock-freedom are those of a step without migration:
nothing stops, nothing is repeated.

What moves: weights and optimizer state do not change inside a step (one update per
global batch, at its end), so a source sends them as soon as the step starts (after
waiting for a host update of the layer still in flight); the target receives them
before its first new-layout forward and takes over the layer's update. The source
keeps running the layer for the micro-batches before the cutover; after its last
backward it sends the gradient it accumulated for them, and the target adds it to
its own before the step's update. Then the source has dropped the layer. Both
directions and several layers at once: every (source, target) pair exchanges one
message of each kind, on its own tags, point to point on the compute group.

Messages are a length (int64) then a torch.save'd payload (uint8): the payload holds
tensors of any shape and an optimizer's state of any kind. A peer that dies makes the
receive fail within the collective timeout, raised as an error naming the layers.
"""

from __future__ import annotations

import io
import time

import torch
import torch.distributed as dist

STATE_TAG, GRAD_TAG = 2, 3


def send_blob(obj, dst: int, tag: int, group, device) -> tuple[list, int]:
    """isend a picklable object holding tensors; (works with their buffers, bytes sent)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8).to(device)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    return [(dist.isend(t, dst, group=group, tag=tag), t) for t in (size, payload)], payload.numel()


def recv_blob(src: int, tag: int, group, device):
    size = torch.empty(1, dtype=torch.int64, device=device)
    dist.recv(size, src, group=group, tag=tag)
    payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.recv(payload, src, group=group, tag=tag)
    return torch.load(io.BytesIO(payload.cpu().numpy().tobytes()), weights_only=False), payload.numel()


class MigrationError(RuntimeError):
    pass


class Migration:
    """One rank's part of moving layers from `stage.stage_layers` to `new_stages` during one step."""

    def __init__(self, stage, new_stages: list[list[str]]):
        self.stage, self.old, self.new = stage, stage.stage_layers, [list(s) for s in new_stages]
        m = stage.micro_batches
        self.cutover = m // 2
        names = stage.model.names
        old_of = {n: s for s, names_ in enumerate(self.old) for n in names_}
        new_of = {n: s for s, names_ in enumerate(self.new) for n in names_}
        self.moves = [(n, old_of[n], new_of[n]) for n in names if old_of[n] != new_of[n]]
        rank = stage.rank
        self.outgoing: dict[int, list[int]] = {}   # target stage -> indices of layers leaving this rank
        self.incoming: dict[int, list[int]] = {}   # source stage -> indices of layers arriving here
        for name, src, dst in self.moves:
            if src == rank:
                self.outgoing.setdefault(dst, []).append(names.index(name))
            if dst == rank:
                self.incoming.setdefault(src, []).append(names.index(name))
        self.received = not self.incoming
        self.sent_bytes = 0
        self.duration_ms = 0.0
        self._works: list = []
        self._t0 = 0.0

    def use_new(self, micro_batch: int) -> bool:
        return micro_batch >= self.cutover

    def _peer(self, stage_index: int) -> int:
        return dist.get_global_rank(self.stage.group, stage_index)

    def _names(self, indices: list[int]) -> list[str]:
        return [self.stage.model.names[i] for i in indices]

    def _fail(self, what: str, indices: list[int], peer: int, e: Exception) -> MigrationError:
        return MigrationError(f"migration of {', '.join(self._names(indices))} ({what} stage {peer}) failed: "
                              f"{type(e).__name__}: {e}")

    def start(self) -> None:
        """Sources: each leaving layer's weights, buffers and optimizer state go to its target, now."""
        self._t0 = time.perf_counter()
        st = self.stage
        for dst, indices in self.outgoing.items():
            blob = {}
            for i in indices:
                layer = st.model.layers[i]
                saved = st.updater.drop_layer(i)   # waits for a host update of the layer still in flight
                blob[st.model.names[i]] = {"params": [p.detach().cpu() for p in layer.parameters()],
                                           "buffers": [b.detach().cpu() for b in layer.buffers()], **saved}
            works, nbytes = send_blob(blob, self._peer(dst), STATE_TAG, st.group, st.device.torch_device)
            self._works += [(w, t, dst, indices) for w, t in works]
            self.sent_bytes += nbytes

    def receive_state(self) -> None:
        """Targets: take over the arriving layers (before running any of them)."""
        if self.received:
            return
        st = self.stage
        for src, indices in self.incoming.items():
            try:
                blob, _ = recv_blob(self._peer(src), STATE_TAG, st.group, st.device.torch_device)
            except Exception as e:
                raise self._fail("weights from", indices, src, e) from e
            for i in indices:
                entry, layer = blob[st.model.names[i]], st.model.layers[i]
                with torch.no_grad():
                    for t, v in zip(list(layer.parameters()) + list(layer.buffers()),
                                    entry["params"] + entry["buffers"]):
                        t.copy_(v)
                st.updater.add_layer(i, list(layer.parameters()), entry.get("state"), entry.get("side", "device"))
        self.received = True

    def finish(self) -> None:
        """After the step's last backward: sources send the gradients they accumulated before the
        cutover; targets add them. Then every send of the migration is waited on."""
        st = self.stage
        dev = st.device.torch_device
        self.receive_state()   # a target whose new layers saw no micro-batch (cannot happen with cutover < m)
        if self.cutover > 0:
            for dst, indices in self.outgoing.items():
                grads = {st.model.names[i]: [None if p.grad is None else p.grad.detach().cpu()
                                             for p in st.model.layers[i].parameters()] for i in indices}
                works, nbytes = send_blob(grads, self._peer(dst), GRAD_TAG, st.group, dev)
                self._works += [(w, t, dst, indices) for w, t in works]
                self.sent_bytes += nbytes
            for src, indices in self.incoming.items():
                try:
                    grads, _ = recv_blob(self._peer(src), GRAD_TAG, st.group, dev)
                except Exception as e:
                    raise self._fail("gradients from", indices, src, e) from e
                for i in indices:
                    for p, g in zip(st.model.layers[i].parameters(), grads[st.model.names[i]]):
                        if g is None:
                            continue
                        if p.grad is None:
                            p.grad = g.to(p.device, p.dtype).clone()
                        else:
                            p.grad.add_(g.to(p.device, p.dtype))
        for work, _, dst, indices in self._works:
            try:
                work.wait()
            except Exception as e:
                raise self._fail("sending to", indices, dst, e) from e
        for indices in self.outgoing.values():   # the source no longer holds these layers' gradients
            for i in indices:
                for p in st.model.layers[i].parameters():
                    p.grad = None
        self._works = []
        self.duration_ms = (time.perf_counter() - self._t0) * 1000
