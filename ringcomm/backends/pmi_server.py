"""A PMI-1 server: what MPICH's processes ask their launcher while MPI starts, answered by
ringcomm itself, so that processes another launcher started (torchrun) form one MPI world.

MPICH's ``MPI_Init`` asks a process manager over a socket (``PMI_PORT``, the "simple PMI"
wire protocol Hydra speaks): its rank and the job's size, a key-value space where each process
puts its address and gets the others', barriers, and which ranks share a node
(``PMI_process_mapping``: MPICH then uses shared memory between them). This module answers the
same questions, one thread per process, in a process of its own that rank 0 starts (this file
run as a script, which imports nothing but the standard library: MPI's start holds the
interpreter's lock of the process that starts it, so the server cannot be a thread there); see
:mod:`ringcomm.backends.mpi_join` for how the processes find it.

Each process also keeps a second connection of ringcomm's own, its lifeline
(``cmd=lifeline``): Hydra ends every process of a job where one calls MPI_Abort (MPICH's
MPI_Abort returns, leaving that to its launcher) or ends before MPI_Finalize, and so does this
server, telling each lifeline to end its process (``cmd=die``, with the abort's status), or,
once every process has finalized, that all is well (``cmd=bye``). A process that ends
without MPICH's exit handler (one that multiprocessing forked) says there that its
``MPI_Finalize`` returned (``cmd=finalized``).

Nothing waits forever: a process that does not connect within ``timeout``, a connection that
closes before ``finalize`` (its process ended), an abort, or the end of the process that
started the server before it connected, fails the job (every process is told to end), and
the server ends. Barriers have no timeout, as under Hydra: the one in ``MPI_Finalize`` waits
for the slowest rank, however long its work takes.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import secrets
import socket
import sys
import threading
import time
import urllib.parse
from collections.abc import Sequence
from typing import Any

__all__ = ["PMIServer", "parse", "process_mapping"]

_LOG = logging.getLogger("ringcomm.pmi")

#: Seconds between looks at whether the process that started the server still lives.
_PARENT_POLL_S = 1.0
#: Seconds between looks, while no process connects, at whether the connect deadline passed.
_ACCEPT_POLL_S = 0.5


def parse(line: bytes) -> dict[str, str]:
    """The ``key=value`` fields of one line of the wire protocol."""
    return dict(f.split("=", 1) for f in line.decode(errors="replace").split() if "=" in f)


def process_mapping(nodes: Sequence[str]) -> str:
    """``PMI_process_mapping`` for ranks on ``nodes`` (one node key per rank, in rank order),
    as Hydra writes it: ``(vector,(first node, nodes, ranks each),...)``.

    >>> process_mapping(["a", "a", "b", "b"])
    '(vector,(0,2,2))'
    >>> process_mapping(["a", "b", "a"])
    '(vector,(0,2,1),(0,1,1))'
    """
    ids: dict[str, int] = {}
    runs: list[list[int]] = []  # [node id, ranks] per run of consecutive ranks on one node
    for node in nodes:
        node_id = ids.setdefault(node, len(ids))
        if runs and runs[-1][0] == node_id:
            runs[-1][1] += 1
        else:
            runs.append([node_id, 1])
    blocks: list[list[int]] = []  # [first node, nodes, ranks each]
    for node_id, count in runs:
        last = blocks[-1] if blocks else None
        if last is not None and last[2] == count and node_id == last[0] + last[1]:
            last[1] += 1
        else:
            blocks.append([node_id, 1, count])
    return "(vector," + ",".join(f"({a},{b},{c})" for a, b, c in blocks) + ")"


class PMIServer:
    """Answers the PMI-1 requests of ``size`` MPICH processes (``PMI_ID`` 0 to size - 1).

    Args:
        size: how many processes will connect.
        mapping: ``PMI_process_mapping`` (:func:`process_mapping`).
        host: the address to listen on (one the other processes reach).
        timeout: seconds the server waits for every process to connect before every
            waiting process is failed.
    """

    def __init__(self, size: int, mapping: str, host: str, timeout: float) -> None:
        self.size = size
        self.kvsname = f"ringcomm_{os.getpid()}_{secrets.token_hex(6)}"
        self._timeout = timeout
        self._kvs: dict[str, str] = {"PMI_process_mapping": mapping}
        self._cond = threading.Condition()
        self._arrived = 0
        self._generation = 0
        self._ids: set[int] = set()
        self._finished: set[int] = set()
        self._serving: set[int] = set()  # processes whose connection is open
        self._failure: str | None = None
        self._die = ""  # what every lifeline is told once the job failed
        self._lifelines: list[socket.socket] = []  # see _lifeline
        self._listener = socket.create_server((host, 0), backlog=max(size, 8))
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, name="ringcomm-pmi", daemon=True).start()

    @property
    def failure(self) -> str | None:
        """Why the job failed (a process gone before MPI_Finalize, an abort, processes that
        did not connect in time), or None."""
        return self._failure

    def close(self) -> None:
        """Stop taking connections (those open are served to their end)."""
        self._listener.close()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every process has finalized and ended its connection, or the job
        failed (True), or ``timeout``. A process that said on its lifeline that it finalized
        may still send PMI's ``finalize`` as it exits, and MPICH fails on a server gone."""
        with self._cond:
            return self._cond.wait_for(lambda: (len(self._finished) == self.size
                                                and not self._serving)
                                       or self._failure is not None, timeout)

    def connected(self, pmi_id: int) -> bool:
        """Whether process ``pmi_id`` has connected."""
        with self._cond:
            return pmi_id in self._ids

    def fail(self, why: str, code: int = 1) -> None:
        """Fail the job: every waiting process, and every later request, gets ``why``, and
        every process with a lifeline is told to end with status ``code`` (as Hydra ends
        every process of a job where one aborts, or ends before MPI_Finalize)."""
        with self._cond:
            if self._failure is None:
                self._failure = why
                _LOG.warning("ringcomm's PMI server ends the job: %s", why)
                self._die = f"cmd=die code={code} msg={urllib.parse.quote(why)}"
                self._tell(self._die)
            self._cond.notify_all()

    def finish(self) -> None:
        """Tell every lifeline the job ended well (its process may end as it likes)."""
        with self._cond:
            self._tell("cmd=bye")

    def _tell(self, line: str, lifelines: Sequence[socket.socket] | None = None) -> None:
        for lifeline in self._lifelines if lifelines is None else lifelines:
            with contextlib.suppress(OSError):
                lifeline.sendall((line + "\n").encode())

    # ------------------------------------------------------------------ connections
    def _accept(self) -> None:
        deadline = time.monotonic() + self._timeout
        self._listener.settimeout(_ACCEPT_POLL_S)
        while True:
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                with self._cond:
                    missing = self.size - len(self._ids)
                if missing and time.monotonic() > deadline:
                    self.fail(f"{missing} of {self.size} processes did not connect within "
                              f"{self._timeout:g} s")
                    self._listener.close()
                    return
                continue
            except OSError:  # closed
                return
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), name="ringcomm-pmi",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        pmi_id: int | None = None
        try:
            with conn, conn.makefile("rb") as lines:
                for raw in lines:
                    fields = parse(raw)
                    command = fields.get("cmd", "")
                    if command == "lifeline":
                        self._lifeline(conn, lines, fields.get("pmiid", ""))
                        return
                    if command == "initack":
                        pmi_id = self._initack(fields.get("pmiid", ""))
                        if pmi_id is None:
                            return
                        replies = ["cmd=initack", f"cmd=set size={self.size}",
                                   f"cmd=set rank={pmi_id}", "cmd=set debug=0"]
                    else:
                        replies = [self._answer(command, fields, pmi_id)]
                    conn.sendall("".join(r + "\n" for r in replies).encode())
                    if command == "finalize":  # answered: now it may count as done
                        self._finalize(pmi_id)
                    if command in ("finalize", "abort"):
                        return
        except OSError:  # a reset: the process ended
            pass
        finally:
            if pmi_id is not None:
                self._ended(pmi_id)

    def _ended(self, pmi_id: int) -> None:
        """Process ``pmi_id``'s connection ended: a failed job unless it finalized first."""
        with self._cond:
            self._serving.discard(pmi_id)
            finished = pmi_id in self._finished
            self._cond.notify_all()
        if not finished:
            self.fail(f"the process of rank {pmi_id} ended its connection before "
                      "MPI_Finalize (it exited, or its MPI start failed)")

    def _lifeline(self, conn: socket.socket, lines: Any, raw_id: str) -> None:
        """A process's second connection, ringcomm's own: the server writes on it when the
        process must end (``cmd=die``, MPICH's MPI_Abort returns and expects its launcher to
        end the job) or may stop listening (``cmd=bye``). The process writes on it once its
        ``MPI_Finalize`` returned where it will end without MPICH's exit handler, which sends
        PMI's ``finalize`` (``cmd=finalized``, answered ``cmd=finalized_ack``; see
        ringcomm.core.process_end): it then counts as finished."""
        with self._cond:
            self._lifelines.append(conn)
            if self._die:  # too late: the job has failed
                self._tell(self._die, [conn])
        with contextlib.suppress(OSError):  # a reset: the process ended
            for raw in lines:  # until the process ends
                if parse(raw).get("cmd") == "finalized" and raw_id.isdigit():
                    self._finalize(int(raw_id))
                    with self._cond:
                        self._tell("cmd=finalized_ack", [conn])

    def _initack(self, raw: str) -> int | None:
        try:
            pmi_id = int(raw)
        except ValueError:
            pmi_id = -1
        with self._cond:
            if not 0 <= pmi_id < self.size or pmi_id in self._ids:
                failure = (f"a process connected with PMI_ID {raw!r} (expected 0 to "
                           f"{self.size - 1}, once each)")
            else:
                self._ids.add(pmi_id)
                self._serving.add(pmi_id)
                return pmi_id
        self.fail(failure)
        return None

    def _answer(self, command: str, fields: dict[str, str], pmi_id: int | None) -> str:
        if command == "init":
            return (f"cmd=response_to_init rc=0 pmi_version=1 "
                    f"pmi_subversion={fields.get('pmi_subversion', '1')}")
        if command == "get_maxes":
            return "cmd=maxes rc=0 kvsname_max=256 keylen_max=64 vallen_max=1024"
        if command == "get_appnum":
            return "cmd=appnum rc=0 appnum=0"
        if command == "get_my_kvsname":
            return f"cmd=my_kvsname rc=0 kvsname={self.kvsname}"
        if command == "get_universe_size":
            return f"cmd=universe_size rc=0 size={self.size}"
        if command == "put":
            with self._cond:
                self._kvs[fields.get("key", "")] = fields.get("value", "")
            return "cmd=put_result rc=0"
        if command == "get":
            with self._cond:
                value = self._kvs.get(fields.get("key", ""))
            return "cmd=get_result rc=1" if value is None else f"cmd=get_result rc=0 value={value}"
        if command == "barrier_in":
            failure = self._barrier()
            if failure is None:
                return "cmd=barrier_out rc=0"
            return f"cmd=barrier_out rc=1 msg={_word(failure)}"
        if command == "finalize":
            return "cmd=finalize_ack rc=0"
        if command == "abort":
            try:
                code = int(fields.get("exitcode", "1"))
            except ValueError:
                code = 1
            self.fail(f"rank {pmi_id} called MPI_Abort with status {code}", code)
            return "cmd=abort_ack rc=0"
        _LOG.warning("PMI request not supported under ringcomm's PMI server: %s", command)
        return f"cmd={command}_result rc=1 msg=not_supported_by_ringcomm"

    def _barrier(self) -> str | None:
        with self._cond:
            if self._failure is not None:
                return self._failure
            generation = self._generation
            self._arrived += 1
            if self._arrived == self.size:
                self._arrived, self._generation = 0, generation + 1
                self._cond.notify_all()
                return None
            # No timeout: MPI_Finalize's barrier waits for the slowest rank's work, however
            # long (as under Hydra); a process that ends fails it through its connection.
            self._cond.wait_for(lambda: self._generation != generation
                                or self._failure is not None)
            return None if self._generation != generation else self._failure

    def _finalize(self, pmi_id: int | None) -> None:
        with self._cond:
            if pmi_id is not None:
                self._finished.add(pmi_id)
            self._cond.notify_all()


def _word(text: str) -> str:
    """``text`` as one PMI field value (no spaces)."""
    return text.replace(" ", "_").replace("=", ":")


def main(argv: Sequence[str] | None = None) -> int:
    """Serve one job: print the address, then serve until every process has finalized or the
    job failed (also when the process that started the server ends before it connected)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--mapping", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--parent-id", type=int, default=0,
                        help="the PMI_ID of the process that starts the server")
    args = parser.parse_args(argv)
    server = PMIServer(args.size, args.mapping, args.host, args.timeout)
    print(server.address, flush=True)
    parent = os.getppid()

    def watch_parent() -> None:
        # Once it connected, its connection tells when it ends; before, only this does.
        while not server.wait(_PARENT_POLL_S):
            if os.getppid() != parent and not server.connected(args.parent_id):
                server.fail("the process that started the PMI server ended before it "
                            "connected")

    threading.Thread(target=watch_parent, daemon=True).start()
    server.wait()
    if server.failure is None:
        server.finish()
    server.close()
    time.sleep(0.2)  # the last answers leave before the process ends
    return 0 if server.failure is None else 1


if __name__ == "__main__":
    sys.exit(main())
