"""The partitioning layer of every stage: which rank owns what (modes), the hooks that fire
gradient buckets (reducer), the sharded step (runner), state conversion, and stage 3's units."""

from .modes import ELEMENTWISE, PARTITIONS, choose_mode
from .reducer import Reducer
from .runner import FUSED_ADAM_CLASSES, ShardRunner
from .state import MASTER_KEY, consolidate, local_payload, shard_state

__all__ = [
    "MASTER_KEY",
    "ELEMENTWISE",
    "FUSED_ADAM_CLASSES",
    "PARTITIONS",
    "Reducer",
    "ShardRunner",
    "choose_mode",
    "consolidate",
    "local_payload",
    "shard_state",
]
