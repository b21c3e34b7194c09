"""Simulated hosts on one machine (network namespaces on a bridge) for braid's multi-host tests and bench.

    reason = unavailable_reason()                    # None: this machine can make them (root, iproute2, ...)
    with SimulatedHosts(3, rate_mbit=1000) as hosts:
        server = hosts.popen(0, [sys.executable, "server.py", hosts.addresses[0]])
        result = hosts.run(1, [sys.executable, "client.py", hosts.addresses[0]], timeout=30)
        hosts.set_link(1, False)                     # host 1 loses its network

Topology of one instance: a "switch" namespace holding the bridge ``br0``, and one namespace per host
whose ``eth0`` is a veth pair to a port of that bridge. Host h has 10.213.X.(h+1)/24 and, with ``ipv6``,
fd00:b7a1:X::(h+1)/64 too; nothing is routed outside the instance, and the machine's own network is
untouched. Every process of host h also runs in mount and UTS namespaces of that host: its hostname is
``simhost{h}`` (``/etc/hosts`` there names every simulated host) and its /dev/shm is a tmpfs of its own,
shared by the processes of host h only, so shared-memory transports cannot reach across hosts. The rest
of the file system is the machine's, shared by all hosts (like a cluster's shared home directory).

A long-lived "anchor" process per host owns these namespaces; ``popen`` enters them with nsenter, so two
processes of one host share /dev/shm however their lifetimes overlap. Needs root, iproute2 (ip, tc) and
util-linux (unshare, nsenter, mount). This module uses the standard library only, never torch or braid.
"""
from __future__ import annotations

import atexit
import functools
import itertools
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Mapping, Optional, Sequence

# Every setup and teardown command takes milliseconds: this bound only fires when something is broken,
# and it keeps a broken machine from hanging a test session.
COMMAND_TIMEOUT_S = 30.0
DEFAULT_RUN_TIMEOUT_S = 60.0
MAX_HOSTS = 250
INTERFACE = "eth0"  # each host's link, by the name a real host would likely use
DEFAULT_PREFIX = "bsim"

_REQUIRED_TOOLS = ("ip", "tc", "unshare", "nsenter", "mount")
# root's tools live in sbin, which a venv's or a CI's PATH may lack.
_EXTRA_PATH = ("/usr/local/sbin", "/usr/sbin", "/sbin", "/usr/local/bin", "/usr/bin", "/bin")

# Run by each anchor inside its fresh mount and UTS namespaces ($1: hostname, $2: hosts file). unshare's
# --propagation private already made every mount private; it is repeated because a mount propagating back
# would cover the machine's real /dev/shm. The anchor then blocks on its stdin, a pipe from the creating
# process: if that process dies without cleaning up (SIGKILL), EOF ends the anchor too.
_ANCHOR_SETUP = """set -e
mount --make-rprivate /
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mount --bind "$2" /etc/hosts
printf '%s' "$1" > /proc/sys/kernel/hostname
"""
_ANCHOR_HOLD = """echo ready
exec cat >/dev/null 2>&1
"""

_instance_ids = itertools.count()
_live: set = set()  # instances not closed yet, for the atexit backstop
_reaped_prefixes: set = set()


class SimulatedHostsError(RuntimeError):
    """Setting up simulated hosts failed (a command failed or timed out, or the machine cannot make them)."""


def tx_bytes(interface: str = INTERFACE) -> int:
    """Bytes the kernel counts as sent through ``interface`` so far (in a simulated host, its
    uplink by default)."""
    with open(f"/sys/class/net/{interface}/statistics/tx_bytes") as f:
        return int(f.read())


def find_tool(name: str) -> Optional[str]:
    """Absolute path of the executable ``name``, searching PATH and then the usual (s)bin directories."""
    path = os.pathsep.join([os.environ.get("PATH", os.defpath), *_EXTRA_PATH])
    return shutil.which(name, path=path)


def _warn(message: str) -> None:
    print(f"braid.bench.simhosts: {message}", file=sys.stderr, flush=True)


def _run(argv: Sequence[str], *, check: bool = True, timeout: float = COMMAND_TIMEOUT_S,
         env: Optional[Mapping[str, str]] = None) -> subprocess.CompletedProcess:
    """Runs a setup/teardown command; with ``check``, a failure raises SimulatedHostsError with its stderr."""
    try:
        result = subprocess.run(list(argv), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        raise SimulatedHostsError(f"timed out after {timeout:g} s: {' '.join(argv)}") from e
    except OSError as e:
        raise SimulatedHostsError(f"cannot run {argv[0]}: {e}") from e
    if check and result.returncode != 0:
        raise SimulatedHostsError(f"failed (exit {result.returncode}): {' '.join(argv)}: "
                                  f"{result.stderr.strip() or result.stdout.strip()}")
    return result


def _tools_env() -> dict:
    """Our environment with sbin on PATH, for the commands that set hosts up (the anchors' scripts)."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([env.get("PATH", os.defpath), *_EXTRA_PATH])
    return env


def _tools() -> dict:
    tools = {name: find_tool(name) for name in (*_REQUIRED_TOOLS, "sh")}
    missing = [name for name, path in tools.items() if path is None]
    if missing:
        raise SimulatedHostsError(f"missing tools: {', '.join(missing)}")
    return tools


def _ns_id(path: str) -> Optional[tuple]:
    """Identity (device, inode) of the namespace behind ``path`` (a /run/netns file or /proc/PID/ns link)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def _netns_names(ip: str) -> list:
    out = _run([ip, "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_namespace_processes(ns_ids: set, deadline_s: float = 5.0) -> None:
    """SIGKILLs every process whose network namespace is one of ``ns_ids``: the children that escaped
    their process group (setsid, daemons) included. Repeats while any is found, since one may fork
    between the scan and its kill."""
    if not ns_ids:
        return
    end = time.monotonic() + deadline_s
    while True:
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid() and _ns_id(f"/proc/{entry}/ns/net") in ns_ids:
                found.append(int(entry))
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass  # gone meanwhile
        if not found:
            return
        if time.monotonic() > end:
            _warn(f"processes still alive in simulated hosts after SIGKILL: {found}")
            return
        time.sleep(0.05)


def _delete_netns(ip: str, names: Sequence[str]) -> None:
    """Deletes the named network namespaces, logging (not raising) what fails."""
    for name in names:
        try:
            result = _run([ip, "netns", "delete", name], check=False)
            if result.returncode != 0:
                _warn(f"ip netns delete {name}: {result.stderr.strip()}")
        except SimulatedHostsError as e:
            _warn(str(e))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _reap_stale(prefix: str) -> None:
    """Deletes namespaces left by an earlier process with this prefix that is dead now (killed before its
    cleanup ran); a live process's namespaces are left alone, so parallel test runs are safe."""
    if prefix in _reaped_prefixes:
        return
    _reaped_prefixes.add(prefix)
    ip = find_tool("ip")
    if ip is None:
        return
    pattern = re.compile(rf"^{re.escape(prefix)}(\d+)x")
    try:
        owners = {name: int(m.group(1)) for name in _netns_names(ip) if (m := pattern.match(name))}
    except SimulatedHostsError as e:
        _warn(f"listing namespaces: {e}")
        return
    stale = [name for name, pid in owners.items() if pid != os.getpid() and not _pid_alive(pid)]
    if stale:
        _warn(f"deleting namespaces left by dead processes: {' '.join(stale)}")
        ids = {i for i in (_ns_id(f"/run/netns/{name}") for name in stale) if i is not None}
        _kill_namespace_processes(ids)
        _delete_netns(ip, stale)


def _tbf_args(rate_mbit: float) -> list:
    """tc arguments of a token bucket for ``rate_mbit``. The bucket holds at least 16 KiB (ten full frames)
    and 4 ms of traffic, so a coarse kernel timer (HZ=250) cannot hold the link below its rate; 50 ms of
    queue is a switch's buffer, enough for TCP to fill the link without inflating its round trip much."""
    bytes_per_s = rate_mbit * 1e6 / 8
    burst = max(16 * 1024, int(bytes_per_s * 0.004))
    return ["tbf", "rate", f"{max(1, round(rate_mbit * 1000))}kbit", "burst", str(burst), "latency", "50ms"]


@functools.lru_cache(maxsize=None)
def _probe(ipv6: bool, rate: bool) -> Optional[str]:
    """Tries the whole recipe on a throwaway namespace; the reason it fails, or None."""
    if os.geteuid() != 0:
        return "simulated hosts need root (network namespaces, mounts)"
    try:
        tools = _tools()
    except SimulatedHostsError as e:
        return str(e)
    ip = tools["ip"]
    name = f"{DEFAULT_PREFIX}{os.getpid()}xprobe"
    tmpdir = None
    try:
        _run([ip, "netns", "add", name])
    except SimulatedHostsError as e:
        return f"cannot create a network namespace: {e}"
    try:
        steps = [
            ("veth pairs unsupported",
             [ip, "-n", name, "link", "add", "pa", "type", "veth", "peer", "name", "pb"]),
            ("bridges unsupported", [ip, "-n", name, "link", "add", "br0", "type", "bridge"]),
            ("bridges unsupported", [ip, "-n", name, "link", "set", "pb", "master", "br0"]),
        ]
        if ipv6:
            steps.append(("IPv6 unavailable",
                          [ip, "-n", name, "-6", "addr", "add", "fd00:b7a1::1/64", "dev", "pa", "nodad"]))
        if rate:
            steps.append(("tbf qdisc unavailable",
                          [tools["tc"], "-n", name, "qdisc", "add", "dev", "pa", "root", *_tbf_args(100)]))
        for reason, argv in steps:
            try:
                _run(argv)
            except SimulatedHostsError as e:
                return f"{reason}: {e}"
        tmpdir = tempfile.mkdtemp(prefix="bsim-probe-")
        hosts_file = os.path.join(tmpdir, "hosts")
        with open(hosts_file, "w") as f:
            f.write("127.0.0.1 localhost\n")
        try:
            _run([ip, "netns", "exec", name, tools["unshare"], "--mount", "--uts", "--propagation", "private",
                  tools["sh"], "-c", _ANCHOR_SETUP, "anchor", "simprobe", hosts_file], env=_tools_env())
        except SimulatedHostsError as e:
            return f"cannot give a host its own mounts and hostname: {e}"
        return None
    finally:
        _delete_netns(ip, [name])
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)


def unavailable_reason(*, ipv6: bool = False, rate: bool = False) -> Optional[str]:
    """None when SimulatedHosts can be made on this machine, else why not. ``ipv6`` and ``rate`` also ask for
    IPv6 and for rate limiting (the tbf qdisc). Probes by building a throwaway namespace; cached."""
    return _probe(False, False) or (_probe(ipv6, rate) if ipv6 or rate else None)


class SimulatedHosts:
    """``n_hosts`` simulated hosts on one bridge, made on entry (construction) and removed on ``close``.

    ``rate_mbit`` limits each host's egress (a tbf qdisc on its ``eth0``); ``ipv6`` adds a ULA address per
    host; ``prefix`` starts the namespaces' names (letters, digits, underscores), which also hold the pid
    and a per-process counter so that concurrent instances and test runs never collide. Interface names
    (br0, p{h}, eth0) are per instance, each instance having its own switch namespace.
    """

    def __init__(self, n_hosts: int, *, rate_mbit: Optional[float] = None, ipv6: bool = False,
                 prefix: Optional[str] = None) -> None:
        prefix = DEFAULT_PREFIX if prefix is None else prefix
        if not 1 <= n_hosts <= MAX_HOSTS:
            raise ValueError(f"n_hosts must be in [1, {MAX_HOSTS}], got {n_hosts}")
        if rate_mbit is not None and not rate_mbit > 0:
            raise ValueError(f"rate_mbit must be positive, got {rate_mbit}")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", prefix):
            raise ValueError(f"prefix must be letters, digits and underscores, got {prefix!r}")
        reason = unavailable_reason(ipv6=ipv6, rate=rate_mbit is not None)
        if reason is not None:
            raise SimulatedHostsError(f"simulated hosts unavailable: {reason}")
        _reap_stale(prefix)

        self._tools = _tools()
        instance = next(_instance_ids)
        base = f"{prefix}{os.getpid()}x{instance}"
        self.n_hosts = n_hosts
        self.rate_mbit = rate_mbit
        self.ipv6 = ipv6
        # Only for telling instances apart in logs and captures: instances never share a network.
        self.subnet = (os.getpid() * 7 + instance) % 250 + 1
        self.switch_namespace = f"{base}-sw"
        self.namespaces = [f"{base}-h{h}" for h in range(n_hosts)]
        self.hostnames = [f"simhost{h}" for h in range(n_hosts)]
        self._addresses = [f"10.213.{self.subnet}.{h + 1}" for h in range(n_hosts)]
        self._addresses6 = [f"fd00:b7a1:{self.subnet:x}::{h + 1:x}" for h in range(n_hosts)] if ipv6 else []
        self._anchors: list = []
        self._children: list = []
        self._made: list = []  # namespaces created so far, for a cleanup after a partial setup
        self._ns_ids: set = set()
        self._tmpdir: Optional[str] = None
        self._closed = False
        _live.add(self)
        try:
            self._setup()
        except BaseException:
            self.close()
            raise

    # ---- setup -------------------------------------------------------------------------------------

    def _ip(self, *args: str) -> None:
        _run([self._tools["ip"], *args])

    def _add_netns(self, name: str) -> None:
        self._ip("netns", "add", name)
        self._made.append(name)
        ns_id = _ns_id(f"/run/netns/{name}")
        if ns_id is not None:
            self._ns_ids.add(ns_id)
        self._ip("-n", name, "link", "set", "lo", "up")

    def _setup(self) -> None:
        sw = self.switch_namespace
        self._add_netns(sw)
        # Without snooping the bridge floods multicast, as IPv6 neighbour discovery needs (no querier here).
        self._ip("-n", sw, "link", "add", "br0", "type", "bridge", "mcast_snooping", "0")
        self._ip("-n", sw, "link", "set", "br0", "up")
        for h, ns in enumerate(self.namespaces):
            self._add_netns(ns)
            self._ip("-n", sw, "link", "add", f"p{h}", "type", "veth", "peer", "name", INTERFACE, "netns", ns)
            self._ip("-n", sw, "link", "set", f"p{h}", "master", "br0")
            self._ip("-n", sw, "link", "set", f"p{h}", "up")
            self._ip("-n", ns, "addr", "add", f"{self._addresses[h]}/24", "dev", INTERFACE)
            if self.ipv6:
                # By default a link going down drops its IPv6 addresses, and set_link(h, True) would bring
                # it back without them.
                _run([self._tools["ip"], "netns", "exec", ns, self._tools["sh"], "-c",
                      f"echo 1 > /proc/sys/net/ipv6/conf/{INTERFACE}/keep_addr_on_down"])
                # nodad: usable at once, not after a second of duplicate detection.
                self._ip("-n", ns, "-6", "addr", "add", f"{self._addresses6[h]}/64", "dev", INTERFACE,
                         "nodad")
            if self.rate_mbit is not None:
                _run([self._tools["tc"], "-n", ns, "qdisc", "add", "dev", INTERFACE, "root",
                      *_tbf_args(self.rate_mbit)])
            self._ip("-n", ns, "link", "set", INTERFACE, "up")

        self._tmpdir = tempfile.mkdtemp(prefix=f"{self.switch_namespace}-")
        hosts_file = os.path.join(self._tmpdir, "hosts")
        with open(hosts_file, "w") as f:
            try:
                with open("/etc/hosts") as real:
                    f.write(real.read().rstrip("\n") + "\n")
            except OSError:
                f.write("127.0.0.1 localhost\n")
            f.write("# simulated hosts (braid.bench.simhosts)\n")
            for h, name in enumerate(self.hostnames):
                f.write(f"{self._addresses[h]} {name}\n")
                if self.ipv6:
                    f.write(f"{self._addresses6[h]} {name}\n")
        for h in range(self.n_hosts):
            self._start_anchor(h, hosts_file)

    def _start_anchor(self, h: int, hosts_file: str) -> None:
        t = self._tools
        # ip netns exec, unshare (without --fork) and the script's final exec all replace the process, so
        # the anchor's pid is the Popen's: the pid that nsenter --target needs. ip netns exec also mounts a
        # /sys of the host's network namespace, which the anchor's mount namespace inherits.
        argv = [t["ip"], "netns", "exec", self.namespaces[h], t["unshare"], "--mount", "--uts",
                "--propagation", "private", t["sh"], "-c", _ANCHOR_SETUP + _ANCHOR_HOLD, "anchor",
                self.hostnames[h], hosts_file]
        anchor = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  env=_tools_env(), start_new_session=True)
        self._anchors.append(anchor)
        output = b""
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        while b"ready\n" not in output:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([anchor.stdout], [], [], left)[0]:
                self._fail_anchor(h, anchor, f"not ready after {COMMAND_TIMEOUT_S:g} s")
            chunk = os.read(anchor.stdout.fileno(), 4096)
            if not chunk:
                self._fail_anchor(h, anchor, "exited during setup")
            output += chunk
        # Its stdout and stderr now point at /dev/null; only stdin stays open, as its lifeline.
        anchor.stdout.close()
        anchor.stderr.close()

    def _fail_anchor(self, h: int, anchor: subprocess.Popen, what: str) -> None:
        anchor.kill()
        try:
            _, err = anchor.communicate(timeout=COMMAND_TIMEOUT_S)
        except (subprocess.TimeoutExpired, ValueError):
            err = b""
        raise SimulatedHostsError(f"anchor of host {h} {what}: {err.decode(errors='replace').strip()}")

    # ---- public API --------------------------------------------------------------------------------

    @property
    def addresses(self) -> list:
        """The hosts' IPv4 addresses, host h at index h."""
        return list(self._addresses)

    @property
    def addresses6(self) -> list:
        """The hosts' IPv6 addresses, host h at index h (empty without ``ipv6``)."""
        return list(self._addresses6)

    @property
    def anchor_pids(self) -> list:
        """Pids of the processes holding each host's namespaces (for tests of the cleanup)."""
        return [a.pid for a in self._anchors]

    @property
    def closed(self) -> bool:
        return self._closed

    def _host(self, host_index: int) -> int:
        if self._closed:
            raise RuntimeError("SimulatedHosts is closed")
        if not 0 <= host_index < self.n_hosts:
            raise IndexError(f"host index {host_index} out of range for {self.n_hosts} hosts")
        return host_index

    def child_env(self, env: Optional[Mapping[str, str]] = None) -> dict:
        """The environment of processes run on a host: ours (PATH, the venv's variables, PYTHONPATH...)
        updated with ``env``. The directory of the interpreter running the tests goes first on PATH when it
        is missing there (a venv used without activation), so that children's "python" is this one."""
        merged = dict(os.environ)
        path = merged.get("PATH", os.defpath)
        bindir = os.path.dirname(sys.executable)
        if bindir and bindir not in path.split(os.pathsep):
            merged["PATH"] = os.pathsep.join([bindir, path])
        if env:
            merged.update(env)
        return merged

    def popen(self, host_index: int, argv: Sequence[str], *, env: Optional[Mapping[str, str]] = None,
              **popen_kwargs) -> subprocess.Popen:
        """Starts ``argv`` on host ``host_index``: in its network, mount (/dev/shm) and UTS (hostname)
        namespaces. ``env`` updates the inherited environment. Other keywords go to subprocess.Popen
        (``cwd`` included); the child leads a new session (process group) unless ``start_new_session=False``
        is given, so that ``close`` can kill it with its descendants."""
        h = self._host(host_index)
        if isinstance(argv, (str, bytes)):
            raise TypeError("argv must be a sequence of arguments, not a string")
        for key in ("executable", "shell"):
            if popen_kwargs.get(key):
                raise TypeError(f"popen does not support {key}=: the command runs through nsenter")
        cwd = os.path.abspath(os.fspath(popen_kwargs.pop("cwd", None) or os.getcwd()))
        popen_kwargs.setdefault("start_new_session", True)
        # Entering a mount namespace moves the working directory to its root: --wd takes ours along.
        full = [self._tools["nsenter"], "--target", str(self._anchors[h].pid), "--net", "--mount", "--uts",
                f"--wd={cwd}", "--", *[os.fspath(a) for a in argv]]
        proc = subprocess.Popen(full, env=self.child_env(env), **popen_kwargs)
        self._children.append(proc)
        return proc

    def run(self, host_index: int, argv: Sequence[str], timeout: float = DEFAULT_RUN_TIMEOUT_S, *,
            env: Optional[Mapping[str, str]] = None, input: Optional[str] = None,
            check: bool = False) -> subprocess.CompletedProcess:
        """Runs ``argv`` on host ``host_index`` to completion and returns its exit status and output (text).
        Past ``timeout`` seconds it is killed with its process group and subprocess.TimeoutExpired raised;
        with ``check``, a non-zero exit raises subprocess.CalledProcessError."""
        proc = self.popen(host_index, argv, env=env,
                          stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            self._kill_child(proc)
            try:
                out, err = proc.communicate(timeout=COMMAND_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                out, err = None, None
            raise subprocess.TimeoutExpired(list(argv), timeout, out, err) from None
        result = subprocess.CompletedProcess(list(argv), proc.returncode, out, err)
        if check:
            result.check_returncode()
        return result

    def set_link(self, host_index: int, up: bool) -> None:
        """Takes host ``host_index``'s link down (``up=False``: it loses the network, as if unplugged) or
        back up. Addresses stay; connections in flight see timeouts or errors as on a real link loss."""
        h = self._host(host_index)
        self._ip("-n", self.namespaces[h], "link", "set", INTERFACE, "up" if up else "down")

    # ---- cleanup -----------------------------------------------------------------------------------

    def _kill_child(self, proc: subprocess.Popen) -> None:
        """SIGKILLs a child and its process group if it still runs, then reaps it."""
        if proc.poll() is None:
            try:
                # Only a group it leads: killpg on a child that kept our group would kill the test runner.
                # Not once reaped either: its pid may then name another process's group.
                if os.getpgid(proc.pid) == proc.pid:
                    os.killpg(proc.pid, signal.SIGKILL)
                else:
                    proc.kill()
            except OSError:
                pass  # exited meanwhile
        try:
            proc.wait(timeout=COMMAND_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _warn(f"process {proc.pid} did not die after SIGKILL")

    def close(self) -> None:
        """Kills every process started on the hosts and deletes the namespaces. Idempotent; never raises
        (errors go to stderr), so it is safe in ``finally`` blocks and at exit."""
        if self._closed:
            return
        self._closed = True
        _live.discard(self)
        for proc in self._children:
            try:
                self._kill_child(proc)
            except Exception as e:  # noqa: BLE001 - cleanup goes on
                _warn(f"killing process {proc.pid}: {e}")
        for anchor in self._anchors:
            try:
                if anchor.stdin is not None:
                    anchor.stdin.close()
                self._kill_child(anchor)
            except Exception as e:  # noqa: BLE001
                _warn(f"killing anchor {anchor.pid}: {e}")
        try:
            # What escaped the process groups (setsid, daemons) would keep the namespaces alive unnamed.
            _kill_namespace_processes(self._ns_ids)
        except Exception as e:  # noqa: BLE001
            _warn(f"killing processes in the simulated hosts: {e}")
        _delete_netns(self._tools["ip"], list(reversed(self._made)))
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    def __enter__(self) -> SimulatedHosts:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"SimulatedHosts({self.n_hosts}, {self.switch_namespace}, {state})"


@atexit.register
def _close_all() -> None:
    """Backstop for instances a test did not close (an exception between creation and ``with``)."""
    for hosts in list(_live):
        hosts.close()
