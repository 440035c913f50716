"""How the server stops: SIGTERM as Ctrl-C, and requests in flight aborted at once.

uvicorn catches SIGTERM while it serves and raises it again once it has
stopped; with Python's default action that second SIGTERM would kill the
process before the engine process is told to stop. Here SIGTERM raises
KeyboardInterrupt instead, which unwinds through the shutdown code (before
uvicorn serves, while the engine still loads, it does so at once). The signal
is also recorded: where library code swallows the exception (a bare except
around an import), start-up raises it again at its next wait, or before serving.

Once uvicorn is told to stop it waits a grace period for open requests,
then cancels them mid-flight; ``abort_requests_on_exit`` fails them first
(a 503, or an error event in a stream) so they end cleanly and at once.
"""

from __future__ import annotations

import asyncio
import signal
import threading

from runtime.engine.core_client import note_stop_request

_POLL_S = 0.1  # uvicorn itself checks should_exit this often


def _interrupt(signum, frame) -> None:
    note_stop_request()  # in case the exception below lands in library code that swallows it
    raise KeyboardInterrupt(f"signal {signum}")


def stop_on_sigterm() -> None:
    """Make SIGTERM raise KeyboardInterrupt in the main thread (signals can only be set there)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)


async def abort_requests_on_exit(server, engine) -> None:
    """Wait until the uvicorn ``server`` is told to stop, then abort every request of ``engine`` (an AsyncLLM)."""
    while not server.should_exit:
        await asyncio.sleep(_POLL_S)
    engine.abort_all("the server is shutting down")
