"""The fault campaign at scale: interruptions of the node agent, one random fault each, against the fake API server,
the fake IMDS and moto's SQS (see ``simulate.campaign`` for the faults and the checks).

Targets: no notice lost and no wrong node touched, over every run. ``python -m bench.faults --runs N`` runs N
(``bench.run`` runs 300); the whole tally goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import sys
import tempfile
from pathlib import Path

import boto3

from bench.common import Result
from bench.common import report as print_results
from simulate.campaign import campaign
from simulate.campaign_tally import report
from simulate.fakes.aws import ACCESS_KEY_ID, REGION, SECRET_ACCESS_KEY, MotoServer

RUNS = 300


async def measure(runs: int = RUNS, *, seed: int = 1, workers: int = 8) -> list[Result]:
    os.environ.update({"AWS_ACCESS_KEY_ID": ACCESS_KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET_ACCESS_KEY})
    asyncio.get_running_loop().set_default_executor(concurrent.futures.ThreadPoolExecutor(32))
    moto = MotoServer()
    moto.start()
    try:
        sqs = boto3.client("sqs", region_name=REGION, endpoint_url=moto.endpoint_url)
        with tempfile.TemporaryDirectory(prefix="spotdrain-faults-") as workdir:
            tally = await campaign(runs=runs, seed=seed, workers=workers, workdir=Path(workdir), moto=moto, sqs=sqs)
    finally:
        moto.stop()
    print(report(tally), file=sys.stderr)
    for problem in tally.problems:
        print(problem, file=sys.stderr)
    detail = json.dumps({k: v for k, v in tally.summary().items() if k in ("runs", "faults", "problems", "seconds")})
    return [
        Result("faults.notices_lost", tally.lost, "notices", 0, tally.lost == 0 and not tally.problems, detail),
        Result("faults.wrong_nodes", tally.wrong_nodes, "runs", 0, tally.wrong_nodes == 0, detail),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.faults", description=__doc__)
    parser.add_argument("--runs", type=int, default=1000, help="interruptions to run (default 1000)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the random faults")
    parser.add_argument("--workers", type=int, default=8, help="interruptions at a time, each on a cluster of its own")
    args = parser.parse_args()
    results = asyncio.run(measure(args.runs, seed=args.seed, workers=args.workers))
    print_results(results)
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
