"""Tests of braid.bench.simhosts, the simulated hosts that the TCP transport's tests run ranks on."""
import os
import subprocess
import sys
import uuid

import pytest
from braid.bench.simhosts import SimulatedHosts, find_tool, unavailable_reason

PY = sys.executable
PORT = 29517  # any port: each instance's hosts have a network of their own
RUN_TIMEOUT_S = 30.0

# Accepts `count` connections on (address, port) and answers each with "<hostname> <peer address>".
SERVER = """
import socket, sys
address, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
srv = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((address, port))
srv.listen(16)
srv.settimeout(20)
for _ in range(count):
    conn, peer = srv.accept()
    with conn:
        conn.sendall(f"{socket.gethostname()} {peer[0]}".encode())
"""

# Connects to each address in turn, retrying while the server is not listening yet, and prints each answer.
CLIENT = """
import socket, sys, time
port = int(sys.argv[1])
for address in sys.argv[2:]:
    deadline = time.monotonic() + 20
    while True:
        try:
            with socket.create_connection((address, port), timeout=5) as c:
                c.settimeout(5)
                answer = b""
                while chunk := c.recv(256):
                    answer += chunk
            print(answer.decode(), flush=True)
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
"""

# One connection attempt with a short timeout: prints "ok" or "failed <exception>".
ONE_ATTEMPT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close()
    print("ok")
except OSError as e:
    print("failed", type(e).__name__, e)
"""


def require(**features: bool) -> None:
    reason = unavailable_reason(**features)
    if reason is not None:
        pytest.skip(reason)


def netns_names() -> set:
    out = subprocess.run([find_tool("ip"), "netns", "list"], capture_output=True, text=True, timeout=30,
                         check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def alive(pid: int) -> bool:
    """Runs (a zombie does not count: it is dead, waiting for its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def py(hosts: SimulatedHosts, host: int, code: str, *args: str, **kwargs) -> str:
    """Runs python code on a host, asserts it succeeded, returns its stdout."""
    result = hosts.run(host, [PY, "-c", code, *args], RUN_TIMEOUT_S, **kwargs)
    assert result.returncode == 0, f"host {host}: exit {result.returncode}: {result.stderr}"
    return result.stdout


@pytest.mark.timeout(60)
def test_each_host_has_its_hostname_and_private_dev_shm():
    require()
    name = f"/dev/shm/bsim-test-{os.getpid()}-{uuid.uuid4().hex}"
    with SimulatedHosts(2) as hosts:
        assert py(hosts, 0, "import socket; print(socket.gethostname())").strip() == "simhost0"
        assert py(hosts, 1, "import socket; print(socket.gethostname())").strip() == "simhost1"
        # The hostnames resolve on every host, to the hosts' addresses.
        code = "import socket, sys; print(socket.gethostbyname(sys.argv[1]))"
        assert py(hosts, 0, code, "simhost1").strip() == hosts.addresses[1]

        py(hosts, 0, "import sys; open(sys.argv[1], 'w').write('x')", name)
        exists = "import os, sys; print(os.path.exists(sys.argv[1]))"
        assert py(hosts, 0, exists, name).strip() == "True"  # a second process of host 0
        assert py(hosts, 1, exists, name).strip() == "False"
        assert not os.path.exists(name)  # the machine's /dev/shm

        # Environment: ours (PATH, the interpreter's) plus the updates.
        out = py(hosts, 1, "import os, sys; print(os.environ['BSIM_MARK'], os.environ['PATH'], sys.prefix)",
                 env={"BSIM_MARK": "marked"})
        mark, path, prefix = out.split()
        assert mark == "marked" and path.endswith(os.environ["PATH"]) and prefix == sys.prefix
        # The working directory follows (entering a mount namespace would reset it to /).
        assert py(hosts, 1, "import os; print(os.getcwd())").strip() == os.getcwd()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("family", ["ipv4", "ipv6"])
def test_tcp_between_hosts(family):
    require(ipv6=family == "ipv6")
    with SimulatedHosts(2, ipv6=family == "ipv6") as hosts:
        addresses = hosts.addresses6 if family == "ipv6" else hosts.addresses
        server = hosts.popen(0, [PY, "-c", SERVER, addresses[0], str(PORT), "1"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        answer = py(hosts, 1, CLIENT, str(PORT), addresses[0]).strip()
        assert answer == f"simhost0 {addresses[1]}"
        _, err = server.communicate(timeout=RUN_TIMEOUT_S)
        assert server.returncode == 0, err


@pytest.mark.timeout(60)
def test_three_hosts_reach_each_other():
    require()
    with SimulatedHosts(3) as hosts:
        servers = [hosts.popen(h, [PY, "-c", SERVER, hosts.addresses[h], str(PORT), "2"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for h in range(3)]
        for h in range(3):
            others = [o for o in range(3) if o != h]
            answers = py(hosts, h, CLIENT, str(PORT), *[hosts.addresses[o] for o in others]).split("\n")
            assert answers[:2] == [f"simhost{o} {hosts.addresses[h]}" for o in others]
        for server in servers:
            _, err = server.communicate(timeout=RUN_TIMEOUT_S)
            assert server.returncode == 0, err


@pytest.mark.timeout(60)
def test_link_down_and_up():
    require(ipv6=True)
    with SimulatedHosts(2, ipv6=True) as hosts:
        hosts.set_link(1, False)
        for address in (hosts.addresses[0], hosts.addresses6[0]):
            assert py(hosts, 1, ONE_ATTEMPT, address, str(PORT)).startswith("failed")
        hosts.set_link(1, True)
        # Back up with its addresses (IPv6 ones included): connections work again, from host 1's address.
        for addresses in (hosts.addresses, hosts.addresses6):
            address, source = addresses[0], addresses[1]
            server = hosts.popen(0, [PY, "-c", SERVER, address, str(PORT), "1"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            assert py(hosts, 1, CLIENT, str(PORT), address).strip() == f"simhost0 {source}"
            _, err = server.communicate(timeout=RUN_TIMEOUT_S)
            assert server.returncode == 0, err


@pytest.mark.timeout(60)
def test_rate_limit_installs_tbf():
    require(rate=True)
    with SimulatedHosts(2, rate_mbit=100) as hosts:
        for h in range(2):
            result = hosts.run(h, [find_tool("tc"), "qdisc", "show", "dev", "eth0"], RUN_TIMEOUT_S)
            assert result.returncode == 0, result.stderr
            assert "tbf" in result.stdout and "rate 100Mbit" in result.stdout, result.stdout


@pytest.mark.timeout(60)
def test_close_removes_namespaces_and_processes():
    require()
    hosts = SimulatedHosts(2)
    names = {hosts.switch_namespace, *hosts.namespaces}
    assert names <= netns_names()
    anchors = hosts.anchor_pids
    assert all(alive(pid) for pid in anchors)
    # A child still running, and a grandchild that left its process group: close() must kill both.
    child = hosts.popen(0, ["sh", "-c", "setsid sleep 600 & echo $!; exec sleep 600"],
                        stdout=subprocess.PIPE, text=True)
    grandchild = int(child.stdout.readline())
    assert alive(grandchild)
    hosts.close()
    hosts.close()  # idempotent
    child.stdout.close()
    assert child.returncode is not None
    assert not alive(grandchild)
    assert not [pid for pid in anchors if alive(pid)]
    assert not names & netns_names()
    with pytest.raises(RuntimeError):
        hosts.popen(0, ["true"])


@pytest.mark.timeout(60)
def test_with_block_cleans_up_after_an_exception():
    require()
    with pytest.raises(ZeroDivisionError):
        with SimulatedHosts(1) as hosts:
            names = {hosts.switch_namespace, *hosts.namespaces}
            anchors = hosts.anchor_pids
            _ = 1 / 0
    assert not names & netns_names()
    assert not [pid for pid in anchors if alive(pid)]
