"""`mergeflow ui` serves the MLflow UI as one process group: it says when the UI answers, and a
SIGTERM or SIGINT stops every process of it (uvicorn workers, job runner, huey consumers)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import BIN, free_port, run_cli

from flows.ui import run_server


def gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie counts as exited)."""
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    return state in ("", "Z")


def group_members(pgid: int) -> list[str]:
    """``pid command`` of each live process in group ``pgid`` (a zombie left to init serves nothing)."""
    table = subprocess.run(["ps", "-e", "-o", "pid=,pgid=,stat=,args="], capture_output=True, text=True).stdout
    rows = [line.split(None, 3) for line in table.splitlines()]
    return [f"{row[0]} {row[3]}" for row in rows if row[1] == str(pgid) and not row[2].startswith("Z")]


def children(pid: int) -> list[int]:
    """The pids of ``pid``'s child processes."""
    return [int(child) for child in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True).stdout.split()]


def port_answers(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:``port``."""
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def ui_env() -> dict[str, str]:
    """This environment with the default tracking URI (the project's mlflow.db), unbuffered."""
    return {**{k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}, "PYTHONUNBUFFERED": "1"}


def test_a_taken_port_is_one_line_and_exit_code_2(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_cli(["ui", "--port", str(port)], tmp_path, ui_env(), timeout=120)
    assert done.returncode == 2
    line = f"mergeflow: error: ui: port {port} on 127.0.0.1 is already in use; pick another with --port"
    assert done.stderr.strip() == line
    assert "starting" not in done.stdout


@pytest.mark.parametrize("status, code", [(3, 3), (0, 1)])  # mlflow ui exits 0 when its port is taken
def test_a_server_dying_while_it_starts_is_reported_with_its_code(status, code, capsys):
    command = [sys.executable, "-c", f"raise SystemExit({status})"]
    assert run_server(command, f"http://127.0.0.1:{free_port()}", str) == code
    assert capsys.readouterr().err == f"mergeflow: ui: the MLflow server exited with code {status} before it answered\n"


def test_sigint_stops_the_servers_whole_group(tmp_path, capsys):
    # A stand-in server that never answers, with a child in its group, as uvicorn and huey are.
    pids = tmp_path / "pids"
    script = (
        "import os, signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGINT, signal.SIG_DFL)\n"  # die quietly, with no KeyboardInterrupt
        "child = subprocess.Popen(['sleep', '120'])\n"
        "open(sys.argv[1], 'w').write(f'{os.getpid()} {child.pid}')\n"
        "time.sleep(120)\n"
    )
    # run_server leaves an ignored SIGINT ignored (as after a shell's `&`); a test run before may have left it so
    # in this process, and the stand-in then slept its 120 s out (exit 0): the test wants Python's default.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=_interrupt_when_written, args=(pids,), daemon=True).start()
        code = run_server([sys.executable, "-c", script, str(pids)], f"http://127.0.0.1:{free_port()}", str)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert code == 0
    assert capsys.readouterr().out.splitlines()[-1] == "mergeflow: ui: stopped on SIGINT"
    server, child = map(int, pids.read_text().split())
    assert gone(server) and gone(child)


def _interrupt_when_written(path: Path) -> None:
    deadline = time.monotonic() + 60
    while not (path.is_file() and len(path.read_text().split()) == 2) and time.monotonic() < deadline:
        time.sleep(0.1)
    os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.slow
def test_sigterm_stops_the_mlflow_ui_and_every_process_it_started(tmp_path):
    (tmp_path / "params.yaml").write_text("tracking: {experiment: merges}\n")
    port, out = free_port(), tmp_path / "out.txt"
    with out.open("w") as stdout, (tmp_path / "err.txt").open("w") as stderr:
        wrapper = subprocess.Popen(
            [str(BIN / "mergeflow"), "ui", "--port", str(port)],
            cwd=tmp_path, env=ui_env(), stdout=stdout, stderr=stderr, start_new_session=True,
        )  # fmt: skip
    try:
        url = _wait_for_url(wrapper, out, port)
        # Printed once the server answers, not before: no polling here.
        assert urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10).status == 200
        assert urllib.request.urlopen(url, timeout=10).status == 200
        (server,) = children(wrapper.pid)
        assert len(group_members(server)) > 3  # mlflow ui, uvicorn and its workers, the job runner, huey

        started = time.monotonic()
        wrapper.send_signal(signal.SIGTERM)
        assert wrapper.wait(timeout=30) == 0
        print(f"stopped in {time.monotonic() - started:.1f} s")
        assert out.read_text().splitlines()[-1] == "mergeflow: ui: stopped on SIGTERM"
        assert group_members(server) == []
        assert not port_answers(port)
    finally:
        for pgid in (*children(wrapper.pid), wrapper.pid):  # the server has a session of its own
            if group_members(pgid):
                os.killpg(pgid, signal.SIGKILL)


def _wait_for_url(wrapper: subprocess.Popen, out: Path, port: int, timeout: float = 300) -> str:
    """The runs URL of the wrapper's output once it prints it, after its one starting line."""
    deadline = time.monotonic() + timeout
    while (found := re.search(r"the runs: (http://\S+)", out.read_text())) is None:
        assert wrapper.poll() is None, f"mergeflow ui exited with {wrapper.returncode}: {out.read_text()}"
        assert time.monotonic() < deadline, f"no URL after {timeout} s: {out.read_text()}"
        time.sleep(0.2)
    started = time.monotonic() - (deadline - timeout)
    print(f"the UI answered {started:.1f} s after the command started")
    ours = [line for line in out.read_text().splitlines() if line.startswith("mergeflow:")]
    assert ours[0] == f"mergeflow: ui: starting the MLflow UI on http://127.0.0.1:{port} …"
    return found.group(1)
