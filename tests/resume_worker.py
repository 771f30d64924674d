"""A real server process for the crash/resume test: the ServerApp's ``run_server`` over an
in-process grid of real ClientApps, slowed down so that a SIGKILL can land inside a round.

Usage: python resume_worker.py '<run-config JSON>' <num-nodes> <seconds-per-train-message>
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flower_grid import InProcessGrid

import client_app
from fedshard.app.config import RunConfig
from fedshard.app.run import run_server


class SlowGrid(InProcessGrid):
    def __init__(self, *args, delay: float, **kw) -> None:
        super().__init__(*args, **kw)
        self.delay = delay

    def push_messages(self, messages):
        messages = list(messages)
        if any(m.metadata.message_type == "train" for m in messages):
            time.sleep(self.delay)
        return super().push_messages(messages)


def main() -> None:
    run_config = json.loads(sys.argv[1])
    nodes, delay = int(sys.argv[2]), float(sys.argv[3])
    grid = SlowGrid(client_app.app, [{"partition-id": i, "num-partitions": nodes}
                                     for i in range(nodes)], run_config, delay=delay)
    run_server(grid, RunConfig.from_mapping(run_config))


if __name__ == "__main__":
    main()
