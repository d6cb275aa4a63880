"""Emulated nodes as network namespaces behind one shaped switch, and their guaranteed removal.

Topology (all of it inside namespaces named ``lbpn-<pid>-*``; the host's own
namespace is never touched, so deleting the namespaces removes every link,
bridge and qdisc):

    lbpn-<pid>-n0  up0 10.77.0.1 --veth-- s0 \\
    lbpn-<pid>-n1  up0 10.77.0.2 --veth-- s1  >-- bridge br0 in lbpn-<pid>-sw
    ...                                      /

Each node's uplink is a veth pair shaped with ``tc tbf`` on both ends (egress
of ``up0`` limits what the node sends, egress of the switch port ``s<i>``
limits what it receives), so the emulated NIC is rate-limited in each
direction. Ranks that share a node namespace talk over its loopback, which is
not shaped (the intra-node links). With ``packages`` (a second tier) each node
namespace holds a bridge instead, with the uplink and one shaped veth per
package namespace ``lbpn-<pid>-n<i>p<j>`` on it.

Cleanup is the reason this module exists: :class:`EmulatedNetwork` removes its
namespaces on normal exit and on exceptions (a context manager), the network
command turns SIGINT/SIGTERM into exceptions, and :func:`sweep_stale` removes
namespaces of earlier runs whose process is gone (a SIGKILLed run), which the
command does before it builds anything.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

PREFIX = "lbpn-"
SUBNET = "10.77.0"
UPLINK = "up0"
CLONE_NEWNET = 0x40000000
_NAME = re.compile(rf"^{PREFIX}(\d+)-")
# Per namespace (these sysctls are per network namespace; the host's are not touched). A
# collective's connection sits idle between collectives longer than TCP's retransmission
# timeout, and Linux then restarts slow start (RFC 2861): every collective would begin by
# probing the tbf again, its round trips lengthened by the other direction's queue, and a
# megabyte message would see well under the shaped rate. An emulated NIC has no such
# start-up cost (RCCL's transports do not slow-start), so it is switched off.
TCP_SETTINGS = {"net.ipv4.tcp_slow_start_after_idle": 0}
# The tbf's bucket: what may leave at the veth's own speed after an idle spell. A NIC sends
# nothing above its line rate, so the bucket is kept to 5 ms of the rate (64 kB at 100 Mbit/s),
# enough for the tbf's timer to hold the rate on a loaded host; at least 4 kB (two full
# frames), at most 64 kB. A fixed 64 kB would let 0.65 s of a 0.8 Mbit/s uplink's traffic
# through at once after every pause.
BURST_S = 0.005
BURST_KB_RANGE = (4, 64)


class NetworkSetupError(RuntimeError):
    """The emulated network cannot be built here; the message is one line saying why."""


def missing_requirements() -> str | None:
    """Why namespaces cannot be built here (one line), or None when they can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth and tc); run as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' not found on PATH (iproute2 is needed)"
    return None


def _run(*cmd: str) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise NetworkSetupError(f"{' '.join(cmd)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def namespaces() -> list[str]:
    """Names of all network namespaces (``ip netns list``)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pids_in(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _remove(ns: str) -> None:
    """End the processes still inside ``ns`` (rank processes this tool started), then delete it."""
    for attempt in range(20):
        pids = [p for p in _pids_in(ns) if p != os.getpid()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05 * (attempt + 1))
    subprocess.run(["ip", "netns", "delete", ns], capture_output=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Delete ``lbpn-<pid>-*`` namespaces whose creating process no longer exists; their names."""
    gone = []
    for ns in namespaces():
        m = _NAME.match(ns)
        if m and not _alive(int(m.group(1))):
            _remove(ns)
            gone.append(ns)
    return gone


def enter(ns: str) -> None:
    """Move the calling thread (a freshly started rank process) into namespace ``ns``."""
    fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {ns}: {os.strerror(err)}")
    finally:
        os.close(fd)


@dataclass
class EmulatedNetwork:
    """``nodes`` namespaces joined by a bridge, each uplink shaped to ``rate_mbit`` each way.

    ``delay_ms`` (optional) adds one-way delay with netem under the tbf on each end.
    With ``packages`` > 0, a second tier: each node namespace holds a bridge
    instead of an address, and each of its ``packages`` packages is a namespace
    ``...n<i>p<j>`` joined to it by a veth shaped to ``package_rate_mbit`` each
    way (traffic between packages of a node); ranks then live in the package
    namespaces and only ranks of one package share a loopback.
    Use as a context manager; :meth:`close` is idempotent.
    """

    nodes: int
    rate_mbit: float
    packages: int = 0
    package_rate_mbit: float = 0.0
    burst_kb: int | None = None     # None: BURST_S of the rate, within BURST_KB_RANGE
    queue_ms: int = 200
    delay_ms: float = 0.0
    tag: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}-")
    created: list[str] = field(default_factory=list)
    shaped: list[tuple[str, str]] = field(default_factory=list)
    uplinks: list[tuple[str, str]] = field(default_factory=list)

    @property
    def switch(self) -> str:
        return f"{self.tag}sw"

    def node_ns(self, i: int) -> str:
        return f"{self.tag}n{i}"

    def address(self, i: int, package: int = 0) -> str:
        """The address ranks of node ``i`` (and ``package`` with the second tier) bind to."""
        return f"10.77.{i}.{package + 1}" if self.packages else f"{SUBNET}.{i + 1}"

    def place(self, i: int, package: int = 0) -> str:
        """The namespace ranks of node ``i`` (and ``package`` with the second tier) live in."""
        return f"{self.node_ns(i)}p{package}" if self.packages else self.node_ns(i)

    def __enter__(self) -> "EmulatedNetwork":
        try:
            self.build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def _add_ns(self, ns: str) -> None:
        _run("ip", "netns", "add", ns)
        self.created.append(ns)
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        for key, value in TCP_SETTINGS.items():
            _run("ip", "netns", "exec", ns, "sysctl", "-q", "-w", f"{key}={value}")

    def burst_for(self, rate_mbit: float) -> int:
        """The tbf's bucket (kB) at ``rate_mbit``: ``burst_kb`` when given, else BURST_S of the
        rate within BURST_KB_RANGE."""
        if self.burst_kb:
            return self.burst_kb
        lo, hi = BURST_KB_RANGE
        return int(max(lo, min(hi, round(rate_mbit * 1e6 / 8 * BURST_S / 1024))))

    def _tbf(self, rate_mbit: float) -> list[str]:
        return ["tbf", "rate", f"{rate_mbit}mbit", "burst", f"{self.burst_for(rate_mbit)}kb",
                "latency", f"{self.queue_ms}ms"]

    def _shape(self, ns: str, dev: str, rate_mbit: float | None = None) -> None:
        self.shaped.append((ns, dev))
        tbf = self._tbf(rate_mbit or self.rate_mbit)
        if self.delay_ms > 0:
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root",
                 "handle", "1:", *tbf)
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "parent", "1:1",
                 "handle", "10:", "netem", "delay", f"{self.delay_ms}ms")
        else:
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", *tbf)

    def build(self) -> None:
        sw = self.switch
        self._add_ns(sw)
        _run("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", sw, "link", "set", "br0", "up")
        for i in range(self.nodes):
            ns = self.node_ns(i)
            self._add_ns(ns)
            port = f"s{i}"
            _run("ip", "-n", sw, "link", "add", port, "type", "veth", "peer", "name", UPLINK,
                 "netns", ns)
            _run("ip", "-n", sw, "link", "set", port, "master", "br0")
            _run("ip", "-n", sw, "link", "set", port, "up")
            _run("ip", "-n", ns, "link", "set", UPLINK, "up")
            if self.packages:
                self._packages(i, ns)
            else:
                _run("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", UPLINK)
            self._shape(ns, UPLINK)
            self._shape(sw, port)
            self.uplinks += [(ns, UPLINK), (sw, port)]

    def _packages(self, i: int, node: str) -> None:
        """Node ``i`` as a bridge: its uplink and one shaped veth per package namespace."""
        _run("ip", "-n", node, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", node, "link", "set", "br0", "up")
        _run("ip", "-n", node, "link", "set", UPLINK, "master", "br0")
        for j in range(self.packages):
            pkg, port = self.place(i, j), f"p{j}"
            self._add_ns(pkg)
            _run("ip", "-n", node, "link", "add", port, "type", "veth", "peer", "name", UPLINK,
                 "netns", pkg)
            _run("ip", "-n", node, "link", "set", port, "master", "br0")
            _run("ip", "-n", node, "link", "set", port, "up")
            _run("ip", "-n", pkg, "addr", "add", f"{self.address(i, j)}/16", "dev", UPLINK)
            _run("ip", "-n", pkg, "link", "set", UPLINK, "up")
            self._shape(pkg, UPLINK, self.package_rate_mbit)
            self._shape(node, port, self.package_rate_mbit)

    def set_rate(self, rate_mbit: float) -> None:
        """Reshape every node uplink (both ends) to ``rate_mbit`` each way, in place."""
        for ns, dev in self.uplinks:
            handle = ["handle", "1:"] if self.delay_ms > 0 else []
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "change", "dev", dev, "root",
                 *handle, *self._tbf(rate_mbit))
        self.rate_mbit = rate_mbit

    def qdiscs(self, stats: bool = False) -> dict[str, str]:
        """``tc qdisc show`` (``-s``: with sent/dropped/overlimit counts) of every shaped device."""
        flag = ["-s"] if stats else []
        out = {}
        for ns, dev in self.shaped:
            text = _run("ip", "netns", "exec", ns, "tc", *flag, "qdisc", "show", "dev", dev)
            out[f"{ns}:{dev}"] = " ".join(text.split())
        return out

    def close(self) -> None:
        # Nodes first (their rank processes), the switch last; each delete takes
        # its veth ends, the bridge and the qdiscs with it.
        for ns in reversed(self.created):
            _remove(ns)
        self.created.clear()
        self.shaped.clear()
        self.uplinks.clear()


def softirq_threads() -> dict[str, float] | None:
    """Run-queue figures of the kernel's softirq threads (``ksoftirqd/N``,
    /proc/<pid>/schedstat), summed: {run_s, wait_s, wakeups}; None where schedstat is not kept.

    Part of an emulated link's packet handling (the tbf's timer releases, the veth's delivery,
    TCP's ACKs) runs as softirq work, which the kernel hands to these nice-0 threads when the
    cores are busy; their wait for a CPU over a run is part of what its collectives wait on."""
    total = {"run_s": 0.0, "wait_s": 0.0, "wakeups": 0}
    found = False
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/comm") as f:
                if not f.read().startswith("ksoftirqd/"):
                    continue
            with open(f"/proc/{name}/schedstat") as f:
                run_ns, wait_ns, slices = (int(v) for v in f.read().split()[:3])
        except (OSError, ValueError):
            continue
        found = True
        total["run_s"] += run_ns / 1e9
        total["wait_s"] += wait_ns / 1e9
        total["wakeups"] += slices
    return total if found else None


def threads_cpu_wait(pid: int | str = "self") -> dict[str, float]:
    """The run-queue figures of every thread of process ``pid`` (/proc/<pid>/task/*/schedstat),
    summed: {run_s, wait_s, wakeups}; zeros where schedstat is not kept."""
    total = {"run_s": 0.0, "wait_s": 0.0, "wakeups": 0}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return total
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                run_ns, wait_ns, slices = (int(v) for v in f.read().split()[:3])
        except (OSError, ValueError):
            continue
        total["run_s"] += run_ns / 1e9
        total["wait_s"] += wait_ns / 1e9
        total["wakeups"] += slices
    return total


def cpu_wait_between(start: dict[str, float] | None,
                    end: dict[str, float] | None) -> dict[str, float] | None:
    """What ran and waited between two readings (:func:`softirq_threads`,
    :func:`threads_cpu_wait`), with the mean wait per wake-up."""
    if not start or not end:
        return None
    d = {k: end[k] - start[k] for k in start}
    d["mean_wait_ms"] = 1e3 * d["wait_s"] / d["wakeups"] if d["wakeups"] else 0.0
    return d


def _terminate(signum, frame):
    # SIGTERM unwinds like Ctrl-C, through every cleanup on the way out.
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def signals_unwind():
    """SIGTERM and SIGINT raise KeyboardInterrupt inside the block, so a command unwinds (and
    removes its namespaces) when sent one; SIGINT too, because a shell starts background jobs
    with SIGINT ignored. The previous handlers come back on the way out."""
    previous = {sig: signal.signal(sig, handler) for sig, handler in (
        (signal.SIGTERM, _terminate), (signal.SIGINT, signal.default_int_handler))}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def command_main(prog: str, run: Callable[[], Any], emit: Callable[[Any], None], *,
                 network: bool = True, refusal_hint: str = "") -> int:
    """A network benchmark's ``main`` around ``run()``: refuse in one line where namespaces
    cannot be built (exit 2; skipped with ``network=False``, a run that builds none), remove
    stale namespaces of earlier runs, run with SIGINT/SIGTERM unwinding, and turn a failed
    rank, a network that cannot be built or a RuntimeError into one error line (exit 1;
    interrupted: 130), the namespaces removed on the way out; else ``emit`` what ``run``
    returned (exit 0). ``refusal_hint`` is added to the refusal line."""
    from megatron_lbp.testing.multirank import MultiRankError

    removed = "; emulated network removed" if network else ""
    if network:
        why = missing_requirements()
        if why:
            print(f"{prog}: error: {why}{refusal_hint}", file=sys.stderr)
            return 2
        sweep_stale()
    with signals_unwind():
        try:
            out = run()
        except MultiRankError as e:
            print(f"{prog}: error: a rank failed{removed}\n{e}", file=sys.stderr)
            return 1
        except (NetworkSetupError, RuntimeError) as e:
            print(f"{prog}: error: {e}{removed}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print(f"{prog}: interrupted{removed}", file=sys.stderr)
            return 130
    emit(out)
    return 0
