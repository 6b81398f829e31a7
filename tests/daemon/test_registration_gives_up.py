"""The registration's deadline, run by the barrier's runner (issue 57): the state decides at --register-deadline
(`BarrierState.registration_deadline`, one of the runner's timers feeds `tick`), and the long polls waiting hear the
failure line, which says what was fed in as it happened (the refusals, the members back)."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import aiohttp

RUN = dict(nodes=3, rounds=20, fragments=2, fanout=1, dim=8, seed=3, train=False, eval_every=0, host="127.0.0.1",
           port=0, round_deadline=30, register_deadline=30, request_timeout=10, insecure=True)


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with session.post(f"{url}/v1/register", json=body) as answer:
        return answer.status, await answer.json()


async def test_a_node_waiting_for_the_roster_hears_the_deadlines_line_with_the_refusals(tmp_path: Path,
                                                                                        kit: Any) -> None:
    barrier, runner, settings = await kit.served_barrier({**RUN, "register_deadline": 1}, tmp_path / "barrier")
    try:
        async with aiohttp.ClientSession() as session:
            refused = await post(session, settings.barrier_url, {"address": "no port"})
            assert refused[0] == 400 and refused[1]["reason"] == "bad_address", refused
            status, answer = await asyncio.wait_for(post(session, settings.barrier_url, {"address": "127.0.0.1:9"}),
                                                    30)
    finally:
        await runner.cleanup()
    assert status == 503 and answer["reason"] == "registration_failed", answer
    assert re.fullmatch(r"registration deadline \(1s\) passed with [01] of 3 nodes; 1 request refused: bad_address "
                        r"x1 from 127\.0\.0\.1 \(an address the other nodes cannot reach\)", answer["detail"]), answer
    # (0 of 3 only where a loaded host took longer than the deadline to send the registration)
    assert barrier.state.phase.value == "failed" and barrier.done.is_set()
    summary = json.loads((tmp_path / "barrier" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] == f"registration failed: {answer['detail']}"


async def test_members_not_all_back_in_time_fail_the_resumed_run_and_those_waiting_hear_who(tmp_path: Path,
                                                                                           kit: Any) -> None:
    """Rank 0's barrier started again (`members_return`): two of three members come back with their checkpoints;
    --register-deadline after the first one back, the run fails naming the third, and both hear it at once."""
    out = tmp_path / "barrier"
    addresses = await kit.barrier_run_stopped(RUN, out, rounds=2)
    again, runner, settings = await kit.served_barrier({**RUN, "register_deadline": 1}, out, members_return=True)
    try:
        async with aiohttp.ClientSession() as session:
            answers = await asyncio.wait_for(asyncio.gather(*(
                post(session, settings.barrier_url, {"address": addresses[r], "checkpoints": [2, 1]})
                for r in (0, 1))), 30)
    finally:
        await runner.cleanup()
    said = again.state.failure  # [1, 2] only where a loaded host sent the second one after the deadline
    assert re.fullmatch(r"members \[(1, )?2\] did not come back within --register-deadline 1s", str(said)), said
    assert [(s, a["reason"], a["detail"]) for s, a in answers] == [(503, "registration_failed", said)] * 2, answers
    assert again.state.phase.value == "failed" and again.done.is_set()
