"""Run a one-stage pipeline whose stage takes a while, once a go-file appears: two of these
started together need the same key at the same moment.

    python tests/lease_worker.py CACHE_DIR [REDIS_URL] LOG GO_FILE

Prints the stage's status and reason as JSON. The stage appends this process's id to LOG
when it runs, so the test counts how many processes built the key.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def slow(inputs, samples, ctx):
    with open(ctx["log"], "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(1.5)
    return {"answer": 42}


def main() -> None:
    *cache_args, log, go = sys.argv[1:]
    from graphbuild.engine.artifact_store import Cache
    from graphbuild.engine.pipeline import Pipeline

    cache = Cache(cache_args[0], url=cache_args[1] if len(cache_args) > 1 else None)
    pipeline = Pipeline(name="lease")
    pipeline.register_stage(slow, "slow", reads=("ctx.log",))
    while not Path(go).exists():
        time.sleep(0.005)
    record = pipeline.run(None, context={"log": log}, cache=cache).report["slow"]
    print(json.dumps({"status": str(record.status), "reason": record.reason}))


if __name__ == "__main__":
    main()
