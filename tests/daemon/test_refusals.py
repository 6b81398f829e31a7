"""What a member hits, the barrier says: a node with the wrong --secret-file is refused (401 bad_tag), and the
barrier's console, its /v1/status and summary.json name the refusal (its reason and source, never a secret)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mosaicd.daemon.barrier.refusals import Refusals
from mosaicd.experiments.cluster import free_ports


def test_refusals_count_all_and_name_the_first_of_each_kind() -> None:
    refusals = Refusals()
    assert refusals.text() == "" and refusals.as_json() == {"total": 0, "by_reason": {}, "from": []}
    assert refusals.note("bad_tag", "10.0.0.2", "/v1/register") is True
    assert refusals.note("bad_tag", "10.0.0.2", "/v1/register") is False  # not news: counted
    assert refusals.note("registration_closed", "10.0.0.3", "/v1/register") is True
    assert refusals.as_json()["by_reason"] == {"bad_tag": 2, "registration_closed": 1}
    assert refusals.text().startswith("3 requests refused: bad_tag x2 from 10.0.0.2 (signed with another secret")


@pytest.mark.slow
def test_a_node_with_the_wrong_secret_shows_on_the_barriers_console_status_and_summary(tmp_path: Path,
                                                                                       kit: Any) -> None:
    out, port = tmp_path / "run", free_ports(1)[0]
    barrier = subprocess.Popen([sys.executable, "-m", "mosaicd", "barrier", "--task", "quadratic", "--nodes", "2",
                                "--rounds", "3", "--fanout", "1", "--host", "127.0.0.1", "--port", str(port), "--out",
                                str(out)], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wrong = tmp_path / "wrong.secret"
    wrong.write_text("not-the-barriers-secret-but-long-enough\n")
    try:
        secret = Path(f"{out}.secret")
        kit.wait_until(lambda: kit.status(port), 60, "the barrier's /v1/status")
        node = subprocess.run([sys.executable, "-m", "mosaicd", "node", "--barrier-url",
                               f"http://127.0.0.1:{port}", "--host", "127.0.0.1", "--port", "0", "--secret-file",
                               str(wrong), "--register-deadline", "5"], capture_output=True, text=True, timeout=60,
                              cwd=tmp_path)
        assert node.returncode != 0 and "bad_tag" in node.stderr, node.stderr
        status = kit.wait_until(lambda: (s := kit.status(port)).get("refused", {}).get("total") and s, 10,
                                "the refusal in /v1/status")
        assert status["refused"]["by_reason"] == {"bad_tag": status["refused"]["total"]}
        assert status["refused"]["from"][0]["source"] == "127.0.0.1"
        assert status["refused"]["from"][0]["path"] == "/v1/register"
    finally:
        os.kill(barrier.pid, signal.SIGINT)
        said = barrier.communicate(timeout=60)[1]
    assert "refused" in said and "bad_tag" in said and "a wrong --secret-file?" in said, said[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["refused"]["by_reason"]["bad_tag"] >= 1, summary
    logged = [json.loads(line) for line in (out / "logs" / "barrier.log").read_text().splitlines()]  # by hand too
    assert any(e["event"] == "refused" and e["reason"] == "bad_tag" for e in logged)
    for text in (said, json.dumps(summary), (out / "logs" / "barrier.log").read_text()):
        assert secret.read_text().strip() not in text and "not-the-barriers-secret" not in text


@pytest.mark.slow
def test_a_node_that_gives_up_registering_says_what_the_barrier_waits_for(tmp_path: Path, kit: Any) -> None:
    port = free_ports(1)[0]
    barrier = subprocess.Popen([sys.executable, "-m", "mosaicd", "barrier", "--task", "quadratic", "--nodes", "3",
                                "--rounds", "3", "--fanout", "1", "--host", "127.0.0.1", "--port", str(port), "--out",
                                str(tmp_path / "run"), "--insecure"], cwd=tmp_path, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        kit.wait_until(lambda: kit.status(port), 60, "the barrier's /v1/status")
        node = subprocess.run([sys.executable, "-m", "mosaicd", "node", "--barrier-url", f"http://127.0.0.1:{port}",
                               "--host", "127.0.0.1", "--port", "0", "--insecure", "--register-deadline", "1"],
                              capture_output=True, text=True, timeout=60, cwd=tmp_path)
    finally:
        barrier.send_signal(signal.SIGINT)
        barrier.wait(timeout=60)
    assert node.returncode == 1, node.stderr
    assert "(the barrier answers: 1 of 3 nodes registered; it holds each registration until all have come" in \
        node.stderr, node.stderr


def test_refusals_keep_every_path_of_a_source_and_reason() -> None:
    refusals = Refusals()
    for path in ("/v1/register", "/v1/arrive", "/v1/register", "/barrier/v1/leave"):
        refusals.note("unsigned", "10.0.0.2", path)
    refusals.note("unsigned", "10.0.0.3", "/v1/arrive")
    assert refusals.as_json()["from"] == [
        {"source": "10.0.0.2", "reason": "unsigned", "path": "/v1/register",
         "paths": ["/v1/register", "/v1/arrive", "/barrier/v1/leave"], "count": 4},
        {"source": "10.0.0.3", "reason": "unsigned", "path": "/v1/arrive", "paths": ["/v1/arrive"], "count": 1}]
