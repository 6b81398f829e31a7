"""The harness itself: the relay delays, a cut host is unreachable until healed, and nothing outlives a lab, not
even one whose process was killed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from harness import RELAY_IP, Lab, require_netns, sh

pytestmark = pytest.mark.netns
HERE = Path(__file__).parent

ECHO = "import socket\ns = socket.create_server(('{ip}', 7000))\nprint('up', flush=True)\n" \
       "c, _ = s.accept()\nwhile d := c.recv(4096):\n    c.sendall(d)\n"
# round trips through the relay: the fastest of 5, or "refused"/"timeout" if the first connection fails
PROBE = textwrap.dedent("""
    import socket, time
    try:
        c = socket.create_connection(('{relay}', 7000), timeout=2)
        c.sendall(b'x'); c.settimeout(2); assert c.recv(1) == b'x'
    except OSError as exc:
        print(type(exc).__name__); raise SystemExit
    best = 9.0
    for _ in range(5):
        t = time.monotonic(); c.sendall(b'x'); assert c.recv(1) == b'x'; best = min(best, time.monotonic() - t)
    print(best)
""")


@pytest.fixture(scope="module")
def netns() -> None:
    require_netns()


def namespaces() -> set[str]:
    return {line.split(" ", 1)[0] for line in sh("ip", "netns", "list").splitlines()}


def probe(lab: Lab) -> str:
    proc = lab.popen(lab.hosts[1], [sys.executable, "-c", PROBE.format(relay=RELAY_IP)])
    out, _ = proc.communicate(timeout=30)
    return out.decode().strip()


def test_relay_delays_and_a_cut_host_is_unreachable_until_healed(netns: None, tmp_path: Path) -> None:
    with Lab(hosts=2) as lab:
        lab.relay(0.05, {7000: f"{lab.ip(0)}:7000"}, tmp_path / "relay.log")
        for _ in range(2):  # one echo connection for each probe that gets through
            echo = lab.popen(lab.hosts[0], [sys.executable, "-c", ECHO.format(ip=lab.ip(0))])
            assert echo.stdout is not None and echo.stdout.readline() == b"up\n"
            lab.cut(1)
            assert probe(lab) == "TimeoutError"  # host 1 reaches nothing, not even the relay
            lab.heal(1)
            assert float(probe(lab)) >= 0.1  # 50 ms each way: the relay sleeps until a chunk is due
            echo.wait(timeout=10)


def test_lab_leaves_nothing_even_when_its_process_was_killed(netns: None) -> None:
    crash = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(HERE)!r})
        from pathlib import Path
        from harness import Lab
        lab = Lab(hosts=2).__enter__()
        sleeper = lab.popen(lab.hosts[0], ['sleep', '300'], log=Path(os.devnull))
        print(lab.id, sleeper.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", crash], capture_output=True, text=True, timeout=60)
    lab_id, pid = proc.stdout.split()
    left = {n for n in namespaces() if n.startswith(f"mosaic-{lab_id}-")}
    assert len(left) == 3 and os.path.exists(f"/proc/{pid}")  # the crash left its namespaces and its process
    with Lab(hosts=1) as lab:  # the next lab removes them
        assert not left & namespaces()
        assert lab.relay_ns in namespaces()
        mine = set(lab.created)
    assert not mine & namespaces()
    assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split()[2]
    with pytest.raises(RuntimeError, match="inside"), Lab(hosts=1) as lab:  # torn down on failure too
        mine = set(lab.created)
        raise RuntimeError("a test failed inside the lab")
    assert not mine & namespaces()
