"""A client of horovodrun's rendezvous server, so that the processes horovodrun starts without
MPI form one MPI world (``ringcomm.backends.mpi_join``) as torchrun's do over PyTorch's store.

horovodrun's own launcher (its "Gloo" mode, used wherever Horovod was not built with MPI) starts
each process with ``HOROVOD_RANK``, ``HOROVOD_SIZE`` and the address of an HTTP key-value store
it serves for the job (``HOROVOD_GLOO_RENDEZVOUS_ADDR`` and ``_PORT``): ``PUT /<scope>/<key>``
stores the request's body, ``GET /<scope>/<key>`` answers it, or 404 while no process has put
the key. :class:`RendezvousStore` speaks that protocol with the calls ``mpi_join`` makes of a
store (``set``, ``get``, ``check``, ``wait``), under a scope of ringcomm's own.
"""

from __future__ import annotations

import datetime
import http.client
import time
import urllib.parse
from collections.abc import Sequence

__all__ = ["SCOPE", "RendezvousStore"]

#: The server's scope ringcomm's keys live in (Horovod's own use "global", "local_<host>" and
#: "cross_<rank>").
SCOPE = "ringcomm"

#: Seconds between looks at the server while waiting for a key: the first, and the longest.
_POLL_S = (0.005, 0.1)
#: Seconds one request may take (the server itself gives a request 3 s to arrive).
_REQUEST_TIMEOUT_S = 30.0


class RendezvousStore:
    """The keys of one scope of horovodrun's rendezvous server, read and written over HTTP.

    Args:
        host, port: where the server listens (``HOROVOD_GLOO_RENDEZVOUS_ADDR`` and ``_PORT``).
        scope: the scope the keys belong to.

    Raises (from every call):
        ConnectionError: the server cannot be reached, or answers other than the protocol says,
            naming its address.
    """

    def __init__(self, host: str, port: int, scope: str = SCOPE) -> None:
        self.host, self.port, self.scope = host, int(port), scope

    def set(self, key: str, value: str | bytes) -> None:
        """Put ``value`` under ``key`` (replacing what was there)."""
        body = value.encode() if isinstance(value, str) else bytes(value)
        status, _ = self._request("PUT", key, body)
        if status != 200:
            raise self._refused("PUT", key, status)

    def get(self, key: str) -> bytes:
        """The value under ``key``.

        Raises:
            KeyError: no process has put ``key`` yet (this does not wait: see :meth:`wait`).
        """
        status, body = self._request("GET", key)
        if status == 404:
            raise KeyError(key)
        if status != 200:
            raise self._refused("GET", key, status)
        return body

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key of ``keys`` is there."""
        for key in keys:
            try:
                self.get(key)
            except KeyError:
                return False
        return True

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta) -> None:
        """Return once every key of ``keys`` is there.

        Raises:
            TimeoutError: after ``timeout``, naming the keys still missing ("timeout" is in
                the message, as in PyTorch's stores' own).
        """
        deadline = time.monotonic() + timeout.total_seconds()
        missing = list(keys)
        pause = _POLL_S[0]
        while True:
            missing = [key for key in missing if not self.check([key])]
            if not missing:
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"timeout after {timeout.total_seconds():g} s waiting for "
                    f"{', '.join(missing)} in horovodrun's rendezvous server at "
                    f"{self.host}:{self.port}")
            time.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
            pause = min(2 * pause, _POLL_S[1])

    def _request(self, method: str, key: str, body: bytes | None = None) -> tuple[int, bytes]:
        # The server splits the path at "/" into exactly scope and key: a key's own "/" (and
        # anything else outside a URL's unreserved characters) is percent-encoded.
        path = f"/{urllib.parse.quote(self.scope, safe='')}/{urllib.parse.quote(key, safe='')}"
        conn = http.client.HTTPConnection(self.host, self.port, timeout=_REQUEST_TIMEOUT_S)
        try:
            conn.request(method, path, body=body,
                         headers={"Content-Length": str(len(body or b""))})
            answer = conn.getresponse()
            return answer.status, answer.read()
        except (OSError, http.client.HTTPException) as err:
            raise ConnectionError(
                f"horovodrun's rendezvous server at {self.host}:{self.port} "
                f"(HOROVOD_GLOO_RENDEZVOUS_ADDR, _PORT) did not answer {method} {path}: "
                f"{err}") from err
        finally:
            conn.close()

    def _refused(self, method: str, key: str, status: int) -> ConnectionError:
        return ConnectionError(f"horovodrun's rendezvous server at {self.host}:{self.port} "
                               f"answered {method} of {key!r} with HTTP status {status}")
