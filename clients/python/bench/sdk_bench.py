"""Figures of the Python SDK for sandcell-bench (which runs this and reads its JSON):
in-session `1+1` through `Sandbox.run_code`, and how long a printed line takes to reach
`on_stdout` (the cell prints its own clock; the host and the sandbox share it).

    python sdk_bench.py --tenant T --jobs 200 --live-jobs 100   # settings: SANDCELL_AMQP_URL, ...
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import List

from sandcell import Sandbox, Settings


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tenant", required=True)
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--live-jobs", type=int, default=100)
    args = parser.parse_args()
    settings = dataclasses.replace(Settings.from_env(), tenant=args.tenant)
    round_trips: List[float] = []
    print_to_callback: List[float] = []
    with Sandbox.create(keep_alive=120, settings=settings) as sb:
        for _ in range(20):
            sb.run_code("1+1")
        for _ in range(args.jobs):
            t0 = time.perf_counter()
            ex = sb.run_code("1+1")
            round_trips.append((time.perf_counter() - t0) * 1000.0)
            assert ex.text == "2", ex.record
        for _ in range(args.live_jobs):
            arrived: List[float] = []

            def on_stdout(text: str) -> None:
                if not arrived:
                    arrived.append(time.time() * 1000.0 - float(text.split()[0]) * 1000.0)

            sb.run_code("import time\nprint(repr(time.time()), flush=True)\ntime.sleep(0.02)", on_stdout=on_stdout)
            print_to_callback.extend(arrived[:1])
    print(json.dumps({"in_session_ms": round_trips, "print_to_on_stdout_ms": print_to_callback}))


if __name__ == "__main__":
    main()
