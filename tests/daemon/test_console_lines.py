"""The console for people: a warning of a kind at most once per interval, saying how many were folded; errors and
JSON logs keep every line."""

from __future__ import annotations

import io
import json

import pytest
import structlog

from mosaicd.logs import FoldRepeats, StderrLogger, json_logs


def test_warnings_fold_per_kind_and_say_how_many() -> None:
    now = [0.0]
    fold = FoldRepeats(every=10.0, clock=lambda: now[0])

    def said(event: str, level: str = "warning") -> dict | None:
        try:
            return fold(None, level, {"event": event, "level": level})
        except structlog.DropEvent:
            return None

    assert said("slow_connect") is not None
    assert [said("slow_connect") for _ in range(40)] == [None] * 40
    assert said("retrying") is not None  # another kind: its own line
    assert said("send_failed", "error") is not None and said("send_failed", "error") is not None  # errors: all
    now[0] = 9.9
    assert said("slow_connect") is None
    now[0] = 10.5
    line = said("slow_connect")
    assert line is not None and line["folded"].startswith("41 more since the last")
    assert said("slow_connect") is None
    now[0] = 21.0
    assert "folded" not in (said("retrying") or {"folded": 1})


@pytest.mark.parametrize(("given", "json"), [(None, False), (False, False), (True, True)])
def test_lines_for_people_unless_json_is_asked_for(given: bool | None, json: bool) -> None:
    assert json_logs(given) is json


def test_a_command_told_to_stop_exits_in_time_whatever_its_threads_do(tmp_path) -> None:
    """`exit_within`: a worker thread mid-training (which nothing interrupts, and which the interpreter waits for at
    exit) does not keep a node told to stop past the time Docker gives it; the output is flushed."""
    import subprocess
    import sys
    import time

    program = ("import sys, threading, time\n"
               "from mosaicd.daemon.entry import exit_promptly, exit_within\n"
               "threading.Thread(target=time.sleep, args=(30,)).start()  # a round's training, not a daemon\n"
               "exit_promptly()\n"
               "exit_within(lambda: 0, 0.5)\n"
               "print('left the run', flush=False)\n")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=30)
    # within seconds (a loaded host's interpreter start and imports among them), not after the thread's 30 s
    assert done.returncode == 0 and done.stdout == "left the run\n" and time.monotonic() - started < 20


def test_a_log_line_goes_out_with_its_end_in_one_write() -> None:
    """On an unbuffered stderr (PYTHONUNBUFFERED, as in the images) each write reaches the file at once: a line and
    its newline written apart let a process SIGKILLed between them leave a line without its end, and the node
    started again in its place joined its first line to it (seen in CI: two JSON objects on one line)."""

    class Writes(io.RawIOBase):
        def __init__(self) -> None:
            self.seen: list[bytes] = []

        def writable(self) -> bool:
            return True

        def write(self, data: bytes) -> int:  # type: ignore[override]
            self.seen.append(bytes(data))
            return len(data)

    raw = Writes()
    logger = StderrLogger(io.TextIOWrapper(raw, write_through=True))  # what python -u makes of stderr
    lines = [json.dumps({"event": "round", "round": i}) for i in range(3)]
    for line in lines:
        logger.info(line)
    assert raw.seen == [f"{line}\n".encode() for line in lines]


@pytest.mark.parametrize(("reason", "code", "line"), [
    ("interrupted (2 of 3 members were told to stop (SIGTERM), ranks [1, 2]: the run was stopped, not failed)", 130,
     "mosaicd node: the run ended after round 7: interrupted (2 of 3 members were told to stop (SIGTERM)"),
    ("rank 1 left, asked by 127.0.0.1:9 with ends_run", 1,
     "mosaicd node: error: the run failed after round 7: rank 1 left"),
])
def test_a_run_a_person_stopped_ends_a_member_without_an_error_line(reason: str, code: int, line: str,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Issue #61: a member that hears its run was interrupted (`outputs.ended_status`) says so and exits 130, as
    docs/faults.md says; one that hears it failed says `error:` and exits 1."""
    from mosaicd.daemon.entry import run_entry
    from mosaicd.daemon.errors import run_ended

    def ends() -> int:
        raise run_ended(reason, " after round 7")
    assert run_entry("node", ends) == code
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 1 and said[0].startswith(line), said
