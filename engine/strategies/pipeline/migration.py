"""Live layer migration between pipeline stages, inside one training step.

    move = Migration(stage, new_stages)     # at the step's start, on every rank (after a RebalanceDecision)
    move.start()                            # sources: send each leaving layer's weights and optimizer state
    move.receive_state()                    # targets: their receives posted (before any other message of the step)
    move.use_new(i)                         # does micro-batch i run with the new layout?
    move.ready(i)                           # the same, the arriving layers taken over before the first that does
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
waiting for a host update of the layer still in flight), and the target posts their
receives at once, before any other message of the step: it waits for the blob's sizes,
then the rest lands while the micro-batches before the cutover run in the old layout,
and the target takes the layers over before its first micro-batch in the new one.
(Measured: a target that posted its receive only at its first new-layout forward stalled
the step for a second, because the unread blob held up the activation gradients queued
behind it on the same connection; one that received the whole blob before its first
forward held the pipeline for its transfer, 27 ms of a 150 ms step at `bench pipeline
--stages 2`.) The target then takes over the layer's update. The source
keeps running the layer for the micro-batches before the cutover; after its last
backward it sends the gradient it accumulated for them, and the target adds it to
its own before the step's update. (Sent as soon as the source's last old-layout
backward had run, it held up the activation gradients behind it on the connection, as
above, until the target's receive at the step's end: the migration step took longer.) Then the source has dropped the layer. Both
directions and several layers at once: every (source, target) pair exchanges one
message of each kind, on its own tags, point to point on the compute group.

Messages are sizes (int64), a pickled skeleton of the object with its tensors taken
out, and the tensors' bytes in one flat uint8 buffer: any optimizer's state, and no
serialisation pass over the tensors (torch.save of 21 MB cost 26 ms to write and 32 ms
to read here). A peer that dies makes the
receive fail within the collective timeout, raised as an error naming the layers.

Stages x replicas: each replica's pipeline moves its own copy of the weights (and its partial gradients) between
its stages, as above. With `data = "sharded"` a layer's optimizer state and masters are its owner's only
(shards.py): they go from the layer's owner in the old stage to its owner in the new one, one copy, point to
point on the world's group on a tag of their own (with the weights, where both owners are the same replica).
"""

from __future__ import annotations

import pickle
import time

import torch
import torch.distributed as dist

from engine.runtime import emulate

STATE_TAG, GRAD_TAG, OWNER_TAG = 2, 3, 6   # tied.py's are 4 and 5


class _Ref:
    """Where a tensor was in a message: its bytes are at [offset, offset + nbytes) of the flat payload."""
    __slots__ = ("offset", "nbytes", "dtype", "shape")

    def __init__(self, offset: int, nbytes: int, dtype, shape):
        self.offset, self.nbytes, self.dtype, self.shape = offset, nbytes, dtype, shape

    def __getstate__(self):
        return (self.offset, self.nbytes, self.dtype, self.shape)

    def __setstate__(self, state):
        self.offset, self.nbytes, self.dtype, self.shape = state


def _split(obj, tensors: list, offset: list):
    """`obj` with every tensor replaced by a _Ref; the tensors (as bytes) appended to `tensors`."""
    if torch.is_tensor(obj):
        raw = obj.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
        tensors.append(raw)
        ref = _Ref(offset[0], raw.numel(), obj.dtype, tuple(obj.shape))
        offset[0] += raw.numel()
        return ref
    if isinstance(obj, dict):
        return {k: _split(v, tensors, offset) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_split(v, tensors, offset) for v in obj)
    return obj


def _join(obj, flat: torch.Tensor):
    if isinstance(obj, _Ref):
        return flat[obj.offset:obj.offset + obj.nbytes].view(obj.dtype).reshape(obj.shape)
    if isinstance(obj, dict):
        return {k: _join(v, flat) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_join(v, flat) for v in obj)
    return obj


def send_blob(obj, dst: int, tag: int, group, device) -> tuple[list, int]:
    """isend an object holding tensors as three messages: sizes, its pickled skeleton, and every tensor's
    bytes in one flat buffer (no serialisation of the tensors themselves); (works with buffers, bytes)."""
    tensors: list = []
    skeleton = pickle.dumps(_split(obj, tensors, [0]))
    flat = torch.cat(tensors) if tensors else torch.empty(0, dtype=torch.uint8)
    meta = torch.frombuffer(bytearray(skeleton), dtype=torch.uint8)
    sizes = torch.tensor([meta.numel(), flat.numel()], dtype=torch.int64)
    msgs = [t.to(device) for t in (sizes, meta, flat)]
    return [(dist.isend(t, dst, group=group, tag=tag), t) for t in msgs], int(meta.numel() + flat.numel())


def post_blob(src: int, tag: int, group, device) -> tuple:
    """A blob's receive begun: its sizes waited for, its skeleton and bytes posted (`take_blob` waits for them)."""
    sizes = torch.empty(2, dtype=torch.int64, device=device)
    dist.recv(sizes, src, group=group, tag=tag)
    meta = torch.empty(int(sizes[0]), dtype=torch.uint8, device=device)
    flat = torch.empty(int(sizes[1]), dtype=torch.uint8, device=device)
    return [dist.irecv(t, src, group=group, tag=tag) for t in (meta, flat)], meta, flat


def take_blob(posted: tuple):
    """The object a posted blob carries, and its bytes, once it has landed."""
    works, meta, flat = posted
    for work in works:
        work.wait()
    return _join(pickle.loads(meta.cpu().numpy().tobytes()), flat.cpu()), int(meta.numel() + flat.numel())


def recv_blob(src: int, tag: int, group, device):
    return take_blob(post_blob(src, tag, group, device))


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
        # sharded replicas: each moving layer's (owner before, owner after), the stage's owners updated now
        self.routes = stage.shards.migrate(self.old, self.new) if stage.shards is not None else None
        self.sent_bytes = 0
        self.duration_ms = 0.0
        self._works: list = []
        self._posted: list | None = None   # receive_state's: (src, indices, the state's blob, the owners' blobs)
        self._t0 = 0.0

    def use_new(self, micro_batch: int) -> bool:
        return micro_batch >= self.cutover

    def ready(self, micro_batch: int) -> bool:
        """use_new; before the first micro-batch that does, the arriving layers are taken over (take_state)."""
        new = micro_batch >= self.cutover
        if new and self._posted is not None:
            self.take_state()
        return new

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
        if self.outgoing and st.ties:
            st.updater.wait_host()   # a tied weight a leaving layer holds may be another layer's update in flight
        for dst, indices in self.outgoing.items():
            blob, owners = {}, {}
            for i in indices:
                layer = st.model.layers[i]
                saved = st.updater.drop_layer(i)   # waits for a host update of the layer still in flight
                route = self.routes.get(i) if self.routes is not None else None
                if route is not None and route[1] != st.replica:   # its state goes to its new owner
                    if route[0] == st.replica:
                        owners.setdefault(route[1], {})[st.model.names[i]] = saved
                    saved = {}
                blob[st.model.names[i]] = {"params": [p.detach().cpu() for p in layer.parameters()],
                                           "buffers": [b.detach().cpu() for b in layer.buffers()], **saved}
            self._send(blob, self._peer(dst), STATE_TAG, st.group, dst, indices)
            for owner, states in owners.items():
                self._send(states, st.grid.rank(dst, owner), OWNER_TAG, st.topo.compute, dst, indices)
            emulate.reached("migration")   # emulate.kill_at: a source with the state on its way

    def _send(self, blob, peer: int, tag: int, group, dst: int, indices: list[int]) -> None:
        works, nbytes = send_blob(blob, peer, tag, group, self.stage.device.torch_device)
        self._works += [(w, t, dst, indices) for w, t in works]
        self.sent_bytes += nbytes

    def receive_state(self) -> None:
        """Targets: the arriving layers' receives posted, before any other message of the step."""
        st, dev = self.stage, self.stage.device.torch_device
        self._posted = []
        for src, indices in self.incoming.items():
            try:
                posted = post_blob(self._peer(src), STATE_TAG, st.group, dev)
                routes = [self.routes[i] for i in indices if i in self.routes] if self.routes is not None else []
                # the state of the layers this replica owns from now, from their owner before
                owners = [post_blob(st.grid.rank(src, owner), OWNER_TAG, st.topo.compute, dev)
                          for owner in sorted({a for a, b in routes if b == st.replica != a})]
            except Exception as e:
                raise self._fail("weights from", indices, src, e) from e
            self._posted.append((src, indices, posted, owners))

    def take_state(self) -> None:
        """Targets: the arriving layers taken over once their state has landed."""
        st, posted, self._posted = self.stage, self._posted or [], None
        for src, indices, blob_posted, owners in posted:
            try:
                blob, _ = take_blob(blob_posted)
                for states in owners:
                    for name, saved in take_blob(states)[0].items():
                        blob[name].update(saved)
            except Exception as e:
                raise self._fail("weights from", indices, src, e) from e
            emulate.reached("migration")   # emulate.kill_at: a target holding the state, not taken over
            for i in indices:
                entry, layer = blob[st.model.names[i]], st.model.layers[i]
                with torch.no_grad():
                    for t, v in zip(list(layer.parameters()) + list(layer.buffers()),
                                    entry["params"] + entry["buffers"]):
                        t.copy_(v)
                # the parameters the layer's update owns (a tied weight: its first holder's), in the order the
                # source's update had them; fp32 masters of bf16 working weights. Sharded replicas: its owner's only
                if self.routes is None or st.shards.owners.get(i) == st.replica:
                    st.updater.add_layer(i, st.owned[i], entry.get("state"), entry.get("side", "device"),
                                         entry.get("master"))

    def send_grads(self) -> None:
        """Sources: the gradients the leaving layers accumulated before the cutover, to their targets."""
        st = self.stage
        sent: set[int] = set()   # a tied weight's gradient goes once, with the first leaving layer holding it
        for dst, indices in self.outgoing.items():
            grads = {}
            for i in indices:
                grads[st.model.names[i]] = entry = []
                for p in st.model.layers[i].parameters():
                    entry.append(None if p.grad is None or id(p) in sent else p.grad.detach().cpu())
                    sent.add(id(p))
            works, nbytes = send_blob(grads, self._peer(dst), GRAD_TAG, st.group, st.device.torch_device)
            self._works += [(w, t, dst, indices) for w, t in works]
            self.sent_bytes += nbytes

    def _wait(self) -> None:
        for work, _, dst, indices in self._works:
            try:
                work.wait()
            except Exception as e:
                raise self._fail("sending to", indices, dst, e) from e
        self._works = []

    def finish(self) -> None:
        """After the step's last backward: sources send the gradients they accumulated before the
        cutover; targets add them. Then every send of the migration is waited on."""
        st = self.stage
        dev = st.device.torch_device
        if self._posted is not None:   # a step whose micro-batches all ran in the old layout (none here)
            self.take_state()
        if self.cutover > 0:
            self.send_grads()
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
        self._wait()
        for indices in self.outgoing.values():   # the source no longer holds these layers' gradients
            for i in indices:
                for p in st.model.layers[i].parameters():
                    p.grad = None
        self.duration_ms = (time.perf_counter() - self._t0) * 1000
