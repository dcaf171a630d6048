"""ringcomm's PMI-1 server (what MPICH asks its launcher while MPI starts), spoken to over real
sockets as MPICH's processes speak to it; MPICH itself starts over it in the torchrun tests
(tests/test_torch_torchrun.py)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ringcomm.backends import pmi_server
from ringcomm.backends.pmi_server import PMIServer, process_mapping


def _expand(mapping: str) -> list[int]:
    """The node of each rank that ``mapping`` describes (how MPICH reads it)."""
    assert mapping.startswith("(vector,") and mapping.endswith(")")
    nodes: list[int] = []
    for block in mapping[len("(vector,"):-1].split("),("):
        first, count, each = (int(v) for v in block.strip("()").split(","))
        for node in range(first, first + count):
            nodes.extend([node] * each)
    return nodes


@pytest.mark.parametrize(("hosts", "expected"), [
    (["a"], "(vector,(0,1,1))"),
    (["a", "a", "a", "a"], "(vector,(0,1,4))"),
    (["a", "a", "b", "b"], "(vector,(0,2,2))"),
    (["a", "b", "c"], "(vector,(0,3,1))"),
    (["a", "a", "b"], "(vector,(0,1,2),(1,1,1))"),
    (["a", "b", "a"], "(vector,(0,2,1),(0,1,1))"),
])
def test_process_mapping_is_written_as_hydra_writes_it(hosts, expected):
    assert process_mapping(hosts) == expected


@given(st.lists(st.sampled_from("abcd"), min_size=1, max_size=40))
def test_process_mapping_places_every_rank_on_its_node(hosts):
    """Read back as MPICH reads it, the mapping puts two ranks on one node exactly when their
    hosts are the same."""
    nodes = _expand(process_mapping(hosts))
    assert len(nodes) == len(hosts)
    for i in range(len(hosts)):
        for j in range(len(hosts)):
            assert (nodes[i] == nodes[j]) == (hosts[i] == hosts[j])


class Client:
    """One process's side of the wire protocol (as MPICH's simple PMI client speaks it)."""

    def __init__(self, address: str) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        self.lines = self.sock.makefile("r")

    def send(self, line: str) -> None:
        self.sock.sendall((line + "\n").encode())

    def ask(self, line: str) -> dict[str, str]:
        self.send(line)
        return self.read()

    def read(self) -> dict[str, str]:
        line = self.lines.readline()
        assert line, "connection closed"
        return dict(f.split("=", 1) for f in line.split())

    def start(self, pmi_id: int) -> dict[str, str]:
        self.send(f"cmd=initack pmiid={pmi_id}")
        answers = [self.read() for _ in range(4)]
        assert answers[0] == {"cmd": "initack"}
        return {k: v for a in answers[1:] for k, v in a.items() if k != "cmd"}

    def close(self) -> None:
        self.lines.close()
        self.sock.close()


def _in_threads(*calls):
    results: list = [None] * len(calls)

    def run(i, call):
        results[i] = call()

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_a_job_starts_exchanges_and_finalizes():
    server = PMIServer(2, "(vector,(0,1,2))", "127.0.0.1", timeout=30)
    clients = [Client(server.address) for _ in range(2)]
    assert [c.start(i) for i, c in enumerate(clients)] == [
        {"size": "2", "rank": "0", "debug": "0"}, {"size": "2", "rank": "1", "debug": "0"}]
    for c in clients:
        assert c.ask("cmd=init pmi_version=1 pmi_subversion=1")["rc"] == "0"
        assert c.ask("cmd=get_maxes")["vallen_max"] == "1024"
        kvs = c.ask("cmd=get_my_kvsname")["kvsname"]
        assert kvs == server.kvsname
        got = c.ask(f"cmd=get kvsname={kvs} key=PMI_process_mapping")
        assert (got["rc"], got["value"]) == ("0", "(vector,(0,1,2))")
        assert c.ask(f"cmd=get kvsname={kvs} key=nothing")["rc"] != "0"
    for i, c in enumerate(clients):
        assert c.ask(f"cmd=put kvsname=k key=card-{i} value=address{i}")["rc"] == "0"
    answers = _in_threads(*(lambda c=c: c.ask("cmd=barrier_in") for c in clients))
    assert [a["rc"] for a in answers] == ["0", "0"]
    assert clients[0].ask("cmd=get kvsname=k key=card-1")["value"] == "address1"
    assert clients[1].ask("cmd=get kvsname=k key=card-0")["value"] == "address0"
    for c in clients:
        assert c.ask("cmd=finalize")["cmd"] == "finalize_ack"
        c.close()
    assert server.wait(10) and server.failure is None


def test_a_process_that_goes_away_fails_the_others_barrier():
    server = PMIServer(3, "(vector,(0,1,3))", "127.0.0.1", timeout=60)
    clients = [Client(server.address) for _ in range(3)]
    for i, c in enumerate(clients):
        c.start(i)
    waiting = _in_threads(lambda: clients[0].ask("cmd=barrier_in"),
                          lambda: (time.sleep(0.3), clients[2].close()))
    assert waiting[0]["rc"] == "1" and "rank_2_ended_its_connection" in waiting[0]["msg"]
    assert "before MPI_Finalize" in server.failure


@pytest.mark.parametrize("pmi_id", ["2", "-1", "x", "0"])
def test_a_process_with_a_wrong_id_fails_the_job(pmi_id):
    server = PMIServer(2, "(vector,(0,1,2))", "127.0.0.1", timeout=60)
    first = Client(server.address)
    first.start(0)
    second = Client(server.address)
    second.send(f"cmd=initack pmiid={pmi_id}")
    assert second.lines.readline() == ""                     # refused: connection closed
    assert server.wait(5) and f"PMI_ID {pmi_id!r}" in server.failure


def test_processes_that_never_connect_fail_the_job():
    server = PMIServer(2, "(vector,(0,1,2))", "127.0.0.1", timeout=2.0)
    client = Client(server.address)
    client.start(0)
    assert server.wait(10) and "1 of 2 processes did not connect" in server.failure
    client.close()


def test_barriers_wait_for_the_slowest_process():
    """Barriers have no timeout (MPI_Finalize's waits however long a rank takes to end its
    work: here 1.5 s against a timeout of 0.5 s); a process that ends fails them (below)."""
    server = PMIServer(2, "(vector,(0,1,2))", "127.0.0.1", timeout=0.5)
    clients = [Client(server.address) for _ in range(2)]
    for i, c in enumerate(clients):
        c.start(i)
    started = _in_threads(*(lambda c=c: c.ask("cmd=barrier_in") for c in clients))
    assert [a["rc"] for a in started] == ["0", "0"]
    finalizing = _in_threads(lambda: clients[0].ask("cmd=barrier_in"),
                             lambda: (time.sleep(1.5), clients[1].ask("cmd=barrier_in"))[1])
    assert [a["rc"] for a in finalizing] == ["0", "0"] and server.failure is None
    for c in clients:
        assert c.ask("cmd=finalize")["cmd"] == "finalize_ack"
        c.close()
    assert server.wait(10) and server.failure is None
    server.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\tZ" not in next(line for line in f if line.startswith("State:"))
    except (OSError, StopIteration):
        return False


def test_the_server_ends_when_its_starter_ends_before_connecting(tmp_path):
    """The server run from its file, as rank 0 runs it, prints its address; where the process
    that started it ends before connecting, it fails the job and ends (nothing left behind)."""
    starter = ("import subprocess, sys\n"
               f"server = subprocess.Popen([sys.executable, '-I', {pmi_server.__file__!r}, "
               "'--size', '2', '--mapping', '(vector,(0,1,2))', '--host', '127.0.0.1', "
               "'--timeout', '60'], stdout=subprocess.PIPE, text=True)\n"
               "print(server.pid, server.stdout.readline().strip(), flush=True)\n"
               "sys.stdin.readline()\n")                 # then it ends, never connecting
    proc = subprocess.Popen([sys.executable, "-c", starter], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        pid, address = proc.stdout.readline().split()
        client = Client(address)                      # rank 1 connects; rank 0 never will
        assert client.start(1)["rank"] == "1"
        time.sleep(1.5)
        assert _alive(int(pid))                       # the job waits for rank 0 meanwhile
        proc.communicate("end\n", timeout=30)
        deadline = time.monotonic() + 30
        while _alive(int(pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(int(pid))
        assert client.lines.readline() == ""          # its connection closed with it
        client.close()
    finally:
        proc.kill()
        proc.wait()


def _started_with_lifelines() -> tuple[PMIServer, list[Client], list[Client]]:
    """A 2-process job whose processes have started and connected their lifelines."""
    server = PMIServer(2, "(vector,(0,1,2))", "127.0.0.1", timeout=30)
    clients = [Client(server.address) for _ in range(2)]
    lifelines = [Client(server.address) for _ in range(2)]
    for i, c in enumerate(clients):
        c.start(i)
        lifelines[i].send(f"cmd=lifeline pmiid={i}")
    return server, clients, lifelines


def test_an_abort_tells_every_lifeline_to_end_with_its_status():
    """MPICH's MPI_Abort returns after telling its launcher; the launcher ends the job. Every
    process's lifeline (ringcomm's second connection) is told to end, with the abort's status;
    a lifeline that connects after the job failed is told at once."""
    server, clients, lifelines = _started_with_lifelines()
    time.sleep(0.3)                                   # the server has taken both lifelines
    clients[1].send("cmd=abort exitcode=3 message=boom")
    for lifeline in lifelines:
        told = lifeline.read()
        assert (told["cmd"], told["code"]) == ("die", "3"), told
        assert "rank%201%20called%20MPI_Abort%20with%20status%203" == told["msg"], told
    late = Client(server.address)
    late.send("cmd=lifeline pmiid=0")
    assert late.read()["cmd"] == "die"
    for c in (*clients, *lifelines, late):
        c.close()
    server.close()


def test_a_process_that_says_it_finalized_may_end_without_finalize():
    """A process multiprocessing forked ends with os._exit, without MPICH's exit handler (which
    sends ``finalize``): it says ``cmd=finalized`` on its lifeline once its MPI_Finalize
    returned, is answered, and its connection may then close without failing the job. The
    server ends only once every connection has ended: the other process still sends
    ``finalize`` as it exits (MPICH fails on a server gone)."""
    server, clients, lifelines = _started_with_lifelines()
    answers = _in_threads(*(lambda c=c: c.ask("cmd=barrier_in") for c in clients))
    assert [a["rc"] for a in answers] == ["0", "0"]  # MPI_Finalize's barrier
    for lifeline in lifelines:
        assert lifeline.ask("cmd=finalized") == {"cmd": "finalized_ack"}
    clients[0].close()  # os._exit: no finalize
    assert not server.wait(0.5)  # rank 1's connection is still open
    assert clients[1].ask("cmd=finalize")["cmd"] == "finalize_ack"  # its exit handler
    clients[1].close()
    assert server.wait(10) and server.failure is None
    for lifeline in lifelines:
        lifeline.close()
    server.close()


def test_a_lifeline_that_never_said_finalized_still_fails_the_job():
    server, clients, lifelines = _started_with_lifelines()
    assert lifelines[1].ask("cmd=finalized") == {"cmd": "finalized_ack"}
    clients[0].close()  # rank 0 gone, having said nothing
    told = lifelines[1].read()
    assert told["cmd"] == "die" and "rank%200%20ended" in told["msg"], told
    assert server.wait(10) and "rank 0 ended its connection before MPI_Finalize" in \
        server.failure
    for c in (*clients, *lifelines):
        c.close()
    server.close()
