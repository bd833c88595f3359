"""An emulated cluster on one machine: each host a network namespace, joined to the others
by a veth pair to one bridge, its link shaped with `tc tbf` in both directions.

    trainyard cluster up --hosts 2 --link 1gbit [--name NAME]   # prints the hosts and how to use them
    trainyard cluster exec HOST -- trainyard run ...           # a command on host HOST (0, 1, ...)
    trainyard cluster status | down [--name NAME]

    with emulated_cluster(hosts=2, link="1gbit") as cluster:   # up, and down again whatever happens
        cluster.command(1, ["trainyard", "run", ...])            # argv that runs on host 1
        enter_host(cluster.hosts[1].netns)                      # this process joins host 1's network

Each host has `lo` and one interface, `ty0`, with the address 10.213.0.<host+1>/24: a private
range that exists only inside these namespaces (the bridge has no address, so the machine's
own network cannot reach them, nor they it). Processes of one host talk over `lo`, unshaped,
as on a real host; everything between hosts crosses the shaped links. The filesystem is shared,
as a cluster's shared filesystem would be.

It needs root (CAP_NET_ADMIN) and `ip netns`; `available()` says why not when it cannot work.
`down` kills every process still inside the namespaces before it deletes them; `emulated_cluster`
runs it however its block ends, a signal to its process included. Namespaces made by a process that
is gone (a SIGKILLed test) are swept by the next `up`.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from engine.processes.children import ChildRuns

INTERFACE = "ty0"            # the one interface of every host, for `[cluster] interface`
SUBNET = "10.213.0"          # host i is 10.213.0.<i+1>/24
STATE_DIR = Path("/run/trainyard-cluster")
MAX_HOSTS = 32
_RATE = re.compile(r"(\d+(?:\.\d+)?)(k|m|g)?bit", re.IGNORECASE)
_NAME = re.compile(r"[a-z0-9]{1,8}")
_LATENCY = re.compile(r"\d+(?:\.\d+)?(ms|us)")
_UNIT = {None: 1, "k": 10**3, "m": 10**6, "g": 10**9}


class ClusterError(RuntimeError):
    """The emulated cluster cannot be made, found or removed; the message says why."""


@dataclass(frozen=True)
class Host:
    index: int
    netns: str
    address: str
    veth: str          # the bridge-side end, in the machine's own namespace


@dataclass(frozen=True)
class Cluster:
    name: str
    hosts: tuple[Host, ...]
    link: str
    burst: str
    latency: str
    interface: str = INTERFACE

    @property
    def bridge(self) -> str:
        return _bridge(self.name)

    def command(self, host: int, argv: list[str]) -> list[str]:
        """argv that runs `argv` on host `host` (in its network namespace)."""
        return ["ip", "netns", "exec", self.hosts[host].netns, *argv]

    def to_dict(self) -> dict:
        return {"name": self.name, "link": self.link, "burst": self.burst, "latency": self.latency,
                "interface": self.interface,
                "hosts": [{"host": h.index, "netns": h.netns, "address": h.address} for h in self.hosts]}


def rate_bits(link: str) -> int:
    """'1gbit' -> 1_000_000_000 (tc's units: bit, kbit, mbit, gbit)."""
    m = _RATE.fullmatch(link.strip())
    if not m or float(m.group(1)) <= 0:
        raise ClusterError(f"--link {link!r}: not a rate like '1gbit', '100mbit' or '500kbit'")
    return int(float(m.group(1)) * _UNIT[(m.group(2) or "").lower() or None])


def default_burst(link: str) -> str:
    # tbf's bucket: 1 ms of the rate, and never below 64 KiB (a segment from the veth's offloads
    # must fit in one bucket, or tbf drops it).
    return f"{max(64 * 1024, rate_bits(link) // 8 // 1000)}b"


def available() -> str | None:
    """None when an emulated cluster can be made here; otherwise the reason it cannot."""
    if os.geteuid() != 0:
        return "the emulated cluster needs root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the emulated cluster needs `{tool}` (iproute2), which is not on PATH"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns` does not work here: {probe.stderr.strip() or probe.returncode}"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(list(args), capture_output=True, text=True)
    if check and done.returncode != 0:
        raise ClusterError(f"`{' '.join(args)}` failed: {done.stderr.strip() or done.returncode}")
    return done


def _hosts(name: str, n: int) -> tuple[Host, ...]:
    return tuple(Host(i, f"trainyard-{name}-h{i}", f"{SUBNET}.{i + 1}", f"ty{name}h{i}") for i in range(n))


def _bridge(name: str) -> str:
    return f"tyb{name}"


def _state_file(name: str) -> Path:
    return STATE_DIR / f"{name}.json"


def up(hosts: int, link: str = "1gbit", name: str = "ty", burst: str | None = None, latency: str = "50ms",
       owner_pid: int | None = None) -> Cluster:
    """Make the namespaces, the bridge and the shaped links. A cluster of the same name is removed first.
    `owner_pid`: the cluster belongs to that process; the next `up` sweeps it away once the process is gone."""
    reason = available()
    if reason:
        raise ClusterError(reason)
    if not _NAME.fullmatch(name):
        raise ClusterError(f"cluster name {name!r}: 1 to 8 lowercase letters or digits")
    if not 2 <= hosts <= MAX_HOSTS:
        raise ClusterError(f"--hosts {hosts}: between 2 and {MAX_HOSTS}")
    rate_bits(link)
    burst = burst or default_burst(link)
    if not _LATENCY.fullmatch(latency):
        raise ClusterError(f"--latency {latency!r}: not a time like '50ms' or '500us'")
    sweep()
    down(name)
    cluster = Cluster(name, _hosts(name, hosts), link, burst, latency)
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    _state_file(name).write_text(json.dumps({**cluster.to_dict(), "owner_pid": owner_pid}))
    try:
        _ip("ip", "link", "add", cluster.bridge, "type", "bridge")
        _ip("ip", "link", "set", cluster.bridge, "up")
        shape = ["tbf", "rate", link, "burst", burst, "latency", latency]
        for h in cluster.hosts:
            peer = f"ty{name}p{h.index}"
            _ip("ip", "netns", "add", h.netns)
            _ip("ip", "link", "add", h.veth, "type", "veth", "peer", "name", peer)
            _ip("ip", "link", "set", peer, "netns", h.netns)
            _ip("ip", "link", "set", h.veth, "master", cluster.bridge)
            _ip("ip", "link", "set", h.veth, "up")
            inside = ["ip", "netns", "exec", h.netns]
            _ip(*inside, "ip", "link", "set", peer, "name", INTERFACE)
            _ip(*inside, "ip", "addr", "add", f"{h.address}/24", "dev", INTERFACE)
            _ip(*inside, "ip", "link", "set", INTERFACE, "up")
            _ip(*inside, "ip", "link", "set", "lo", "up")
            # the host's sending side, and (on the bridge's end) what it receives: a full-duplex link
            _ip(*inside, "tc", "qdisc", "replace", "dev", INTERFACE, "root", *shape)
            _ip("tc", "qdisc", "replace", "dev", h.veth, "root", *shape)
    except BaseException:
        down(name)
        raise
    return cluster


def find(name: str = "ty") -> Cluster:
    """The cluster `name` made by `up` (from its state file)."""
    try:
        state = json.loads(_state_file(name).read_text())
    except (OSError, ValueError):
        raise ClusterError(f"no emulated cluster named {name!r} (start one with `trainyard cluster up`)") from None
    return Cluster(name, _hosts(name, len(state["hosts"])), state["link"], state["burst"], state["latency"])


def _namespaces(name: str | None = None) -> list[str]:
    listed = _ip("ip", "netns", "list", check=False).stdout.split("\n")
    names = [line.split()[0] for line in listed if line.strip()]
    prefix = f"trainyard-{name}-h" if name else "trainyard-"
    return [n for n in names if n.startswith(prefix)]


def _kill_inside(netns: str) -> None:
    """SIGKILL every process in `netns`, and wait (2 s at most) until they are gone."""
    deadline = time.monotonic() + 2.0
    while True:
        pids = [int(p) for p in _ip("ip", "netns", "pids", netns, check=False).stdout.split()]
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def down(name: str = "ty") -> list[str]:
    """Kill what runs inside, delete the namespaces (which deletes their veth pairs) and the bridge.
    Returns the namespaces removed; nothing there is not an error."""
    removed = []
    for netns in _namespaces(name):
        _kill_inside(netns)
        _ip("ip", "netns", "del", netns, check=False)
        removed.append(netns)
    if Path(f"/sys/class/net/{_bridge(name)}").exists():
        _ip("ip", "link", "del", _bridge(name), check=False)
    for stale in Path("/sys/class/net").glob(f"ty{name}h*"):   # a half-made cluster's loose ends
        _ip("ip", "link", "del", stale.name, check=False)
    _state_file(name).unlink(missing_ok=True)
    return removed


def sweep() -> list[str]:
    """Remove the clusters whose owner process is gone (a test run that was killed)."""
    removed = []
    for state in STATE_DIR.glob("*.json") if STATE_DIR.is_dir() else []:
        try:
            owner = json.loads(state.read_text()).get("owner_pid")
        except (OSError, ValueError):
            owner = None
        if owner is not None and not Path(f"/proc/{owner}").exists():
            removed += down(state.stem)
    return removed


@contextlib.contextmanager
def emulated_cluster(hosts: int = 2, link: str = "1gbit", name: str | None = None, **kw):
    """`up` for the duration of the block, and `down` (which kills every process inside) however the block
    ends: an exception, or SIGTERM, SIGINT or SIGHUP to this process, which is raised again once the
    cluster is gone (engine/processes/children.py). Only SIGKILL leaves it, for the next `up` to sweep."""
    reason = available()
    if reason:   # before anything is owned: `down` cannot run here either
        raise ClusterError(reason)
    name = name or f"p{os.getpid()}"
    with ChildRuns() as owned:
        owned.callback(down, name)   # first: a signal during `up` leaves nothing either
        yield up(hosts, link, name=name, owner_pid=os.getpid(), **kw)


_CLONE_NEWNET = 0x40000000


def enter_host(netns: str) -> None:
    """Move this process (before it opens any socket it needs there) into the namespace `netns`."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/run/netns/{netns}") as f:
        if libc.setns(f.fileno(), _CLONE_NEWNET) != 0:
            raise ClusterError(f"cannot enter {netns}: {os.strerror(ctypes.get_errno())}")


def main(argv: list[str]) -> int:
    import argparse
    import sys
    parser = argparse.ArgumentParser(prog="trainyard cluster", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    p_up = sub.add_parser("up", help="make the namespaces and shaped links")
    p_up.add_argument("--hosts", type=int, default=2)
    p_up.add_argument("--link", default="1gbit", help="each host's link rate, tc units (default 1gbit)")
    p_up.add_argument("--burst", help="tbf bucket (default: 1 ms of the rate, at least 64 KiB)")
    p_up.add_argument("--latency", default="50ms", help="tbf's queueing limit (default 50ms)")
    for p in (p_up, sub.add_parser("down", help="kill what runs inside and remove the namespaces"),
              sub.add_parser("status", help="show the cluster")):
        p.add_argument("--name", default="ty", help="cluster name (default ty; 1 to 8 of a-z, 0-9)")
    p_exec = sub.add_parser("exec", help="run a command on one host")
    p_exec.add_argument("host", type=int)
    p_exec.add_argument("argv", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    p_exec.add_argument("--name", default="ty")
    args = parser.parse_args(argv)
    try:
        if args.action == "down":
            removed = down(args.name)
            print(f"removed {len(removed)} hosts" + (f": {', '.join(removed)}" if removed else ""))
            return 0
        if args.action == "up":
            cluster = up(args.hosts, args.link, name=args.name, burst=args.burst, latency=args.latency)
        else:
            cluster = find(args.name)
        if args.action == "exec":
            argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
            if not argv or not 0 <= args.host < len(cluster.hosts):
                parser.error(f"exec HOST -- COMMAND, with HOST in 0..{len(cluster.hosts) - 1}")
            os.execvp("ip", cluster.command(args.host, argv))
    except ClusterError as e:
        print(f"trainyard cluster: {e}", file=sys.stderr)
        return 2
    print(f"emulated cluster {cluster.name!r}: {len(cluster.hosts)} hosts, each link {cluster.link} "
          f"(tbf burst {cluster.burst}, latency {cluster.latency}); interface {cluster.interface}")
    for h in cluster.hosts:
        print(f"  host {h.index}: {h.address}  (netns {h.netns})")
    first = cluster.hosts[0].address
    print(f"run on host R:  trainyard cluster exec R -- trainyard run CONFIG --nnodes {len(cluster.hosts)} "
          f"--node-rank R --rdzv-endpoint {first}:29400 --set cluster.interface={cluster.interface}")
    return 0
