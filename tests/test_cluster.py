"""The emulated cluster's set-up and clean-up (bench/netns.py); root-only parts skip elsewhere."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import netns  # noqa: E402


def test_parse_rate():
    assert netns.parse_rate("1gbit") == 1e9
    assert netns.parse_rate("100mbit") == 1e8
    assert netns.parse_rate("2.5gbit") == 2.5e9
    assert netns.parse_rate("none") is None and netns.parse_rate(None) is None
    with pytest.raises(ValueError, match="rate must look like"):
        netns.parse_rate("fast")


def test_commands_build_shape_and_remove_everything():
    up = netns.commands_up(3, "1gbit", prefix="t")
    flat = [" ".join(c) for c in up]
    assert flat[0] == "ip netns add tsw"
    for r in range(3):
        assert f"ip netns add t{r}" in flat
        assert f"ip -n t{r} addr add 10.213.0.{r + 1}/24 dev eth0" in flat
        # both directions of every rank's link are shaped
        assert any(f"exec t{r} tc qdisc add dev eth0 root tbf rate 1gbit" in c for c in flat)
        assert any(f"exec tsw tc qdisc add dev p{r} root tbf rate 1gbit" in c for c in flat)
    assert not any("tbf" in c for c in map(" ".join, netns.commands_up(2, None, prefix="t")))
    down = [" ".join(c) for c in netns.commands_down(3, prefix="t")]
    assert sorted(down) == sorted([f"ip netns del t{r}" for r in range(3)] + ["ip netns del tsw"])
    # nothing is ever created outside the cluster's own namespaces
    assert all(c[:3] == ["ip", "netns", "add"] or "-n" in c or "netns" in c for c in up)


REASON = netns.unavailable()
needs_root = pytest.mark.skipif(REASON is not None, reason=f"cannot build namespaces: {REASON}")


@needs_root
def test_cluster_up_counts_traffic_and_cleans_up():
    prefix = f"rctest{os.getpid()}x"
    with netns.Cluster(2, "100mbit", prefix=prefix) as cluster:
        assert set(netns.existing(prefix)) == {f"{prefix}0", f"{prefix}1", f"{prefix}sw"}
        before = cluster.tx_bytes()
        code = ("import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
                f"[s.sendto(b'x' * 1000, ('{cluster.address(1)}', 9)) for _ in range(50)]")
        subprocess.run(["ip", "netns", "exec", cluster.namespace(0), sys.executable, "-c", code],
                       check=True, timeout=30)
        assert cluster.tx_bytes()[0] - before[0] >= 50_000
    assert netns.existing(prefix) == []


@needs_root
def test_cluster_cleans_up_when_interrupted(tmp_path):
    prefix = f"rcint{os.getpid()}x"
    script = tmp_path / "hold.py"
    script.write_text(
        f"import sys, time; sys.path.insert(0, {str(BENCH)!r}); import netns\n"
        f"with netns.Cluster(2, '1gbit', prefix={prefix!r}):\n"
        "    print('up', flush=True)\n"
        "    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        assert len(netns.existing(prefix)) == 3
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while netns.existing(prefix) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert netns.existing(prefix) == []


@needs_root
def test_remove_stale():
    prefix = f"rcstale{os.getpid()}x"
    subprocess.run(["ip", "netns", "add", f"{prefix}0"], check=True)
    assert netns.remove_stale(prefix) == [f"{prefix}0"]
    assert netns.existing(prefix) == []
