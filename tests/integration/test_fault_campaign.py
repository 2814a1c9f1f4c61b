"""The fault campaign: a hundred and more interruptions, one random fault each, not one notice lost or node wronged."""

from __future__ import annotations

import asyncio
import concurrent.futures
from pathlib import Path
from typing import TYPE_CHECKING

from simulate.campaign import campaign
from simulate.campaign_tally import KINDS, report
from simulate.fakes.aws import MotoServer

if TYPE_CHECKING:
    from mypy_boto3_sqs import SQSClient

RUNS = 100


async def test_a_hundred_interruptions_with_one_fault_each_lose_nothing(
    moto: MotoServer, sqs: SQSClient, tmp_path: Path
) -> None:
    # Queue-mode agents long-poll on worker threads: leave room for every one of them and their deletes.
    asyncio.get_running_loop().set_default_executor(concurrent.futures.ThreadPoolExecutor(32))
    tally = await campaign(runs=RUNS, seed=9, workers=8, workdir=tmp_path, moto=moto, sqs=sqs)
    print(report(tally))
    assert tally.problems == []
    assert (tally.runs, tally.lost, tally.wrong_nodes) == (RUNS, 0, 0)
    assert set(tally.faults) == set(KINDS), "every kind of fault drawn"
    assert tally.queue_runs >= RUNS // 6
    assert sum(tally.struck.values()) >= RUNS * 3 // 4, "most faults struck (a late point may follow the last call)"
