"""``mergeflow ui``: the MLflow UI as a process group that lives and dies with the command.

``mlflow ui`` forks uvicorn workers and a job runner that forks huey consumers; a signal to its
pid alone leaves them serving the port. So the server runs in a session of its own (a Ctrl-C in
the terminal reaches only the wrapper) and the wrapper forwards SIGTERM and SIGINT to the whole
group, waits for every member to exit, and kills the group if that takes too long.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from types import FrameType

from mergeflow.errors import MergeflowError

HOST = "127.0.0.1"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
STOP_GRACE_S = 15.0  # the group stops in 3 to 10 s on a busy 2-core machine, longer while workers start
KILL_GRACE_S = 5.0
POLL_S = 0.5
# The system proxy, if any, must not see requests to 127.0.0.1.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def base_url(port: int) -> str:
    """The UI's root URL on ``port``."""
    return f"http://{HOST}:{port}"


def port_in_use(port: int) -> bool:
    """Whether something listens on ``HOST:port`` (bound the way uvicorn binds, so TIME_WAIT does not count)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((HOST, port))
        except OSError:
            return True
    return False


def server_command(backend_uri: str, port: int) -> list[str]:
    """The ``mlflow ui`` command line serving ``backend_uri`` on ``HOST:port``."""
    serving = ["--host", HOST, "--port", str(port)]
    return [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", backend_uri, *serving]


class StopRequest:
    """A signal handler that forwards SIGTERM and SIGINT to the server's process group and remembers them."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.pgid: int | None = None
        self.forwarded = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum
        if self.pgid is not None:
            signal_group(self.pgid, signum)
            self.forwarded = True


@contextlib.contextmanager
def handling_stop_signals(handler: StopRequest) -> Iterator[None]:
    """Install ``handler`` for SIGTERM and SIGINT, restoring the previous handlers afterwards.

    A signal ignored on entry stays ignored, as a shell script's ``&`` leaves SIGINT.
    """
    wanted = [signum for signum in STOP_SIGNALS if signal.getsignal(signum) != signal.SIG_IGN]
    previous = {signum: signal.signal(signum, handler) for signum in wanted}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def signal_group(pgid: int, signum: int) -> None:
    """Send ``signum`` to process group ``pgid``, if any member is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signum)


def group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` still has a member."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_group(server: subprocess.Popen, timeout: float) -> bool:
    """Wait until ``server``'s whole group has exited (reaping the leader); whether it did in time."""
    deadline = time.monotonic() + timeout
    while True:
        server.poll()  # the unreaped leader would keep the group alive
        if not group_alive(server.pid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def reap_group(server: subprocess.Popen) -> None:
    """Wait for ``server``'s signalled group to exit, then SIGKILL whatever is left."""
    if wait_group(server, STOP_GRACE_S):
        return
    print(f"mergeflow: ui: the MLflow server did not stop in {STOP_GRACE_S:.0f} s; killing it", file=sys.stderr)
    signal_group(server.pid, signal.SIGKILL)
    wait_group(server, KILL_GRACE_S)


def answers(url: str) -> bool:
    """Whether ``url`` answers 200 now (the port is bound seconds before a worker accepts)."""
    try:
        with _DIRECT.open(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def wait_until_up(server: subprocess.Popen, url: str, stop: StopRequest) -> bool:
    """Poll ``url`` until it answers; False when the server exits or a stop is requested first."""
    while server.poll() is None and stop.signum is None:
        if answers(url):
            return True
        time.sleep(POLL_S)
    return False


def wait_until_done(server: subprocess.Popen, stop: StopRequest) -> None:
    """Block until the server's leader exits or a stop is requested."""
    while stop.signum is None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=POLL_S)
            return


def exit_code(returncode: int) -> int:
    """A child's return code as a shell reports it (128 + N for a child killed by signal N)."""
    return 128 - returncode if returncode < 0 else returncode


def serve_ui(backend_uri: str, port: int, page_url: Callable[[str], str]) -> int:
    """Serve the MLflow UI of ``backend_uri`` on ``port`` until a signal or the server stops.

    Prints one line on start and ``page_url(base)`` once the server answers. Returns 0 after a
    SIGTERM or SIGINT, the server's exit code if it stops by itself.
    """
    if port_in_use(port):
        raise MergeflowError(f"ui: port {port} on {HOST} is already in use; pick another with --port")
    return run_server(server_command(backend_uri, port), base_url(port), page_url)


def run_server(command: list[str], base: str, page_url: Callable[[str], str]) -> int:
    """Run ``command`` as its own process group serving ``base``; see ``serve_ui``."""
    print(f"mergeflow: ui: starting the MLflow UI on {base} …", flush=True)
    stop = StopRequest()
    with handling_stop_signals(stop):
        server = subprocess.Popen(command, start_new_session=True)
        stop.pgid = server.pid
        try:
            import mlflow.tracking  # noqa: F401  # page_url needs it: import it while the server starts

            return _supervise(server, base, page_url, stop)
        finally:
            # The server may have stopped by itself, or page_url failed: no member may outlive the command.
            if group_alive(server.pid):
                signal_group(server.pid, signal.SIGTERM)
                reap_group(server)


def _supervise(server: subprocess.Popen, base: str, page_url: Callable[[str], str], stop: StopRequest) -> int:
    up = wait_until_up(server, f"{base}/health", stop)
    if up:
        print(f"mergeflow: ui: the MLflow UI answers on {base}; the runs: {page_url(base)}", flush=True)
        wait_until_done(server, stop)
    if stop.signum is not None:
        if not stop.forwarded:  # it came before the group existed
            signal_group(server.pid, stop.signum)
        reap_group(server)
        print(f"mergeflow: ui: stopped on {signal.Signals(stop.signum).name}", flush=True)
        return 0
    code = exit_code(server.wait())
    when = "" if up else " before it answered"
    print(f"mergeflow: ui: the MLflow server exited with code {code}{when}", file=sys.stderr, flush=True)
    # mlflow ui exits 0 when uvicorn cannot bind its port: not answering at all is a failure.
    return code if up or code else 1
