"""What a rank posts point to point, in order: NCCL matches one pair's sends and receives in the order they are
posted and ignores their tags, where gloo matches by tag. A step whose two ends post a pair's messages in different
orders passes on the CPU and fails on GPUs, and a pipeline of several GPU stages cannot be run on this project's
machines (one GPU): the tests check the order on gloo instead.

    order = PostingOrder()
    with order:                     # in a pool job, around each step
        stage.train_step(x, y)
    mismatched_pairs([every rank's order.log])   # [] where every pair's two ends agree
"""

from __future__ import annotations


class PostingOrder:
    """Every point-to-point message this rank posts, in the order it posts them, as (peer's global rank, the
    group's name, "send" | "recv", numel, dtype, tag): a group is a communicator of its own under NCCL, so the
    order that counts is each pair's within each group. The tag names the message: the k-th send and the k-th
    receive of a pair must carry the same one, or NCCL lands one message in another's buffer (silently, where
    their sizes agree)."""

    def __init__(self):
        self.log: list[tuple[int, str, str, int, str, int]] = []
        self._saved: dict = {}

    def __enter__(self) -> "PostingOrder":
        import torch.distributed as dist
        for name in ("send", "isend", "recv", "irecv"):
            self._saved[name] = fn = getattr(dist, name)
            setattr(dist, name, self._recorded(fn, "send" if "send" in name else "recv"))
        return self

    def _recorded(self, fn, kind: str):
        def call(tensor, *args, **kwargs):
            peer = args[0] if args else kwargs.get("dst" if kind == "send" else "src")
            group = args[1] if len(args) > 1 else kwargs.get("group")
            tag = args[2] if len(args) > 2 else kwargs.get("tag", 0)
            name = "default" if group is None else group.group_name
            self.log.append((peer, name, kind, tensor.numel(), str(tensor.dtype), tag))
            return fn(tensor, *args, **kwargs)
        return call

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def mismatched_pairs(logs: list[list[tuple]]) -> list[str]:
    """Each (a, b, group) whose sends from a, in a's order, are not b's receives from a, in b's order."""
    bad = []
    groups = sorted({m[1] for log in logs for m in log})
    for a, sent_log in enumerate(logs):
        for b, recv_log in enumerate(logs):
            for group in groups:
                sent = [m[3:] for m in sent_log if m[0] == b and m[1] == group and m[2] == "send"]
                received = [m[3:] for m in recv_log if m[0] == a and m[1] == group and m[2] == "recv"]
                if sent != received:
                    first = next((k for k, (x, y) in enumerate(zip(sent, received)) if x != y),
                                 min(len(sent), len(received)))
                    bad.append(f"{a} -> {b} on group {group}: message {first} sent as {sent[first:first + 1]}, "
                               f"received into {received[first:first + 1]} ({len(sent)} sent, {len(received)} "
                               f"received)")
    return bad
