"""ZeRO stages 1 and 2: which rank owns what, the hooks that fire buckets, the sharded step."""

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
