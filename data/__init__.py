"""Dataset registry: `create_dataset(cfg.dataset, "train")` returns a batched `mindspore.dataset` pipeline.

Each builder takes (dataset config, split, shard) and reads either the embedded data that ships in a
package (`path` unset) or the standard on-disk format at `path`.
"""
import os
from typing import Callable, Dict, Optional, Tuple

DATASETS: Dict[str, Callable] = {}


def register_dataset(name: str):
    def wrap(fn: Callable) -> Callable:
        DATASETS[name] = fn
        return fn
    return wrap


def workers(cfg) -> int:
    """The recipe's worker count, capped at this machine's cores (mindspore.dataset refuses more)."""
    return max(1, min(cfg.num_workers, os.cpu_count() or 1))


def create_dataset(cfg, split: str, shard: Optional[Tuple[int, int]] = None):
    """split: "train" (shuffled, fixed batch shape) or "test"; shard: (num_shards, shard_id) or None."""
    return DATASETS[cfg.name](cfg, split, shard)


from data import images, mnist, translation  # noqa: E402,F401  (registers their datasets)
