"""The engine's hybrid prefix cache (MLA KV blocks + KDA state snapshots) and its public types."""

from splitserve.engine.prefix_cache.events import PrefixEvent
from splitserve.engine.prefix_cache.imported import ImportedPrefix
from splitserve.engine.prefix_cache.retained import RetainedPrefix
from splitserve.engine.prefix_cache.stats import PrefixCacheStats

__all__ = ["ImportedPrefix", "PrefixCacheStats", "PrefixEvent", "RetainedPrefix"]
