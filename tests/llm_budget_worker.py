"""Add HTP contexts to an llm export whose part graphs are in the cache, in a process of its
own, and print how much the resident memory of the process and its children grew meanwhile.

    python tests/llm_budget_worker.py OUT JOBS MEMORY MODEL OPTIONS

The export without contexts runs first (into ``OUT/graphs``, caching every part's graphs in
``OUT/cache``; it also imports and registers what any export does); the measured export then
finds the graphs there, so every part's context preparation is ready at once, each in a child
process: what ``JOBS`` and the budget ``MEMORY`` (bytes, or ``none``) let run at once is what
the measurement sees. ``MODEL`` (:func:`tests.llm_models.causal_lm`'s arguments) and
``OPTIONS`` (the llm format's, contexts on) as JSON. Prints the growth in bytes, the stages
that ran and the most context preparations that ran at once, as JSON.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path


def main() -> None:
    out, jobs, memory, model_args, options = sys.argv[1:]
    from tests.llm_models import causal_lm, export_llm
    from tests.process_memory import TreeRss, tree_rss

    root = Path(out)
    model = causal_lm(**json.loads(model_args))
    options = json.loads(options)
    export_llm(model, root / "graphs", root / "cache", {**options, "contexts": False}, jobs=1)
    gc.collect()
    before = tree_rss(os.getpid())
    with TreeRss(interval=0.01) as measured:
        artifacts = export_llm(
            model,
            root / "out",
            root / "cache",
            options,
            jobs=int(jobs),
            memory=None if memory == "none" else int(memory),
        )
    ran = [s.name for s in artifacts.report.stages if str(s.status) == "ran"]
    spans = [(e["start"], e["end"]) for e in artifacts.report.timeline if ".context." in e["stage"]]
    at_once = max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)
    print(json.dumps({"growth": measured.peak - before, "ran": ran, "at_once": at_once}))


if __name__ == "__main__":
    main()
