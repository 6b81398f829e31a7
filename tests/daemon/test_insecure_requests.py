"""Under --insecure nothing proves who sends a request: the barrier takes a member's leave or withdrawal only from
that member's host (ports are not compared), a failure an unsigned request caused names where it came from, and a
stale or changed layout claim fails nothing and blames no rank. Real barrier, real HTTP on loopback (127.0.0.2 and
127.0.0.3 are other hosts of the loopback network)."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import aiohttp

RUN = dict(nodes=3, rounds=50, fragments=2, fanout=1, dim=8, seed=3, train=False, eval_every=0, host="127.0.0.1",
           port=0, round_deadline=30, register_deadline=30, request_timeout=10, insecure=True)
MEMBERS = ["127.0.0.1:9", "127.0.0.2:9", "127.0.0.3:9"]  # ranks 0, 1, 2 (sorted addresses)
LAYOUT = {"values": 8, "fingerprint": "ab" * 32}
FOREIGN = {"values": 16, "fingerprint": "cd" * 32}


def session_from(host: str) -> aiohttp.ClientSession:
    """Requests that leave from `host` (a loopback address), as a member on that host sends them."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(host, 0)))


async def call(session: aiohttp.ClientSession, method: str, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with session.request(method, url, json=body) as answer:
        return answer.status, await answer.json()


async def test_an_unsigned_request_acts_only_for_its_own_host_and_names_itself(tmp_path: Path, kit: Any) -> None:
    barrier, runner, settings = await kit.served_barrier(RUN, tmp_path / "barrier")
    url = settings.barrier_url
    try:
        async with session_from("127.0.0.1") as here, session_from("127.0.0.2") as two:
            registered = await asyncio.wait_for(asyncio.gather(
                *(call(here, "POST", f"{url}/v1/register", {"address": a}) for a in MEMBERS)), 30)
            assert [r[1]["rank"] for r in registered] == [0, 1, 2], registered
            arrivals = await asyncio.wait_for(asyncio.gather(
                *(call(here, "POST", f"{url}/v1/arrive", {"rank": r, "round": 0, "layout": LAYOUT})
                  for r in range(3))), 30)
            assert [a[0] for a in arrivals] == [200] * 3, arrivals

            # another host's leave or withdrawal of a member: 403, with a JSON reason naming both
            for method, path, body, member in [("POST", "/v1/leave", {"rank": 1, "ends_run": True}, MEMBERS[1]),
                                               ("POST", "/v1/leave", {"rank": 2}, MEMBERS[2]),
                                               ("DELETE", "/v1/register", {"address": MEMBERS[1]}, MEMBERS[1])]:
                status, refused = await call(here, method, f"{url}{path}", body)
                assert status == 403 and refused["reason"] == "not_from_member", (path, status, refused)
                assert "came from 127.0.0.1:" in refused["detail"] and member in refused["detail"], refused
            assert barrier.state.live == [0, 1, 2] and not barrier.state.phases.failed

            # a stale arrival (a released round) with a foreign layout fails nothing; a changed claim of a rank that
            # claimed the run's layout is refused alone (409), blaming no rank
            stale = await call(here, "POST", f"{url}/v1/arrive", {"rank": 0, "round": 0, "layout": FOREIGN})
            assert stale[0] == 200 and stale[1]["round"] == 0, stale
            changed = await call(here, "POST", f"{url}/v1/arrive", {"rank": 0, "round": 1, "layout": FOREIGN})
            assert changed[0] == 409 and changed[1]["reason"] == "layout_changed", changed
            assert not barrier.state.phases.failed and barrier.failure is None

            # the member's own host may: rank 1 leaves from 127.0.0.2
            status, left = await call(two, "POST", f"{url}/v1/leave", {"rank": 1, "reason": "done"})
            assert status == 200 and left["left"] == 1 and barrier.state.live == [0, 2], left

            # an unsigned ends_run of rank 0 (from its host) ends the run, and the failure says who asked
            status, _ = await call(here, "POST", f"{url}/v1/leave", {"rank": 0, "ends_run": True})
            assert status == 200
            async with here.get(f"{url}/v1/status") as answer:
                failure = (await answer.json())["failure"]
    finally:
        await runner.cleanup()
    assert re.fullmatch(r"rank 0 left, asked by 127\.0\.0\.1:\d+ with ends_run", failure), failure
    summary = json.loads((tmp_path / "barrier" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"].startswith("rank 0 left, asked by 127.0.0.1:"), summary
