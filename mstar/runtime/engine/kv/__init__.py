"""The engine's per-request memory: paged KV pages (bookkeeping and tensors) and recurrent slots."""
from mstar.runtime.engine.kv.cache import KvCache
from mstar.runtime.engine.kv.pages import PagePool
from mstar.runtime.engine.kv.slots import SlotPool, SlotPoolError

__all__ = ["KvCache", "PagePool", "SlotPool", "SlotPoolError"]
