"""`python -m tests.deploy.room_holder ADDRESS BUNDLE_JSON`: a Ray job holding one bundle.

Connects to the Ray cluster at ADDRESS, reserves BUNDLE_JSON in a placement group of its own,
prints "held"; on a line on stdin removes it and prints "released" (tests/deploy/ray_hosts.py).
"""

from __future__ import annotations

import json
import sys

import ray
from ray.util.placement_group import placement_group, remove_placement_group

READY_TIMEOUT_S = 120


def main(address: str, bundle: dict[str, float]) -> None:
    ray.init(address=address, log_to_driver=False)
    group = placement_group([bundle])
    ray.get(group.ready(), timeout=READY_TIMEOUT_S)
    print("held", flush=True)
    sys.stdin.readline()
    remove_placement_group(group)
    print("released", flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
