"""The benchmarks' engine stage that logs every step (its time, running and waiting sequences)
and each shard's end, one file per engine actor, and the reader that merges the files (for
`bench_job.py` and `bench_peers.py`)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from pipeline.stages.infer import InferStage


def step_recording_stage(path: Path) -> type[InferStage]:
    """An InferStage that records, per engine step, its time, running and waiting sequences
    and tokens; the log (and the time each shard finished) goes to `path` after each shard,
    or with several engine actors to one file per actor beside it (`read_step_logs`)."""

    class Recorded(InferStage):
        def _new_engine(self, beside=None):  # noqa: ANN001, ANN202
            engine = super()._new_engine(beside)
            # One record per actor, whose engines (engines_per_actor) build in threads of
            # their own: `setdefault` makes them share it.
            fields: dict[str, Any] = self.__dict__
            fields.setdefault("steps", [])  # (start, running, waiting, seconds, engine) per step
            fields.setdefault("shards_done", [])
            fields.setdefault("actor", {})
            fields.setdefault("dump_lock", threading.Lock())  # shards finish in several threads
            step = engine.step
            label = f"{os.getpid()}.{threading.get_ident()}"  # built in its stepping thread

            def recorded():  # noqa: ANN202
                if not self.actor:  # the stepping thread, as it runs the first step
                    import torch

                    self.actor = {
                        "torch_threads": torch.get_num_threads(),
                        "nice": os.getpriority(os.PRIO_PROCESS, 0),
                    }
                started = time.perf_counter()
                outputs = step()
                s = engine.scheduler
                self.steps.append(
                    (started, len(s.running), len(s.waiting), time.perf_counter() - started, label)
                )
                return outputs

            engine.step = recorded
            return engine

        def run_shard(self, shard):  # noqa: ANN001, ANN202
            table = super().run_shard(shard)
            self.shards_done.append(time.perf_counter())
            with self.dump_lock:
                record = {
                    "steps": list(self.steps),
                    "shards_done": list(self.shards_done),
                    "actor": self.actor,
                }
                path.with_name(f"{path.stem}.{os.getpid()}{path.suffix}").write_text(
                    json.dumps(record)
                )
            return table

    return Recorded


def read_step_logs(path: Path) -> dict[str, Any]:
    """The logs `step_recording_stage(path)` wrote, one per engine actor, merged: the steps
    of every engine in time order (the last field names the engine), each shard's end,
    and each actor's stepping thread."""
    logs = [json.loads(f.read_text()) for f in sorted(path.parent.glob(f"{path.stem}.*"))]
    return {
        "steps": sorted(s for log in logs for s in log["steps"]),
        "shards_done": sorted(t for log in logs for t in log["shards_done"]),
        "actor": logs[0]["actor"] if len(logs) == 1 else [log["actor"] for log in logs],
        "actors": len(logs),
    }
