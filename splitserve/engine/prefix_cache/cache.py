"""The engine's hybrid prefix cache: MLA KV blocks and KDA snapshots, hit all or nothing."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from splitserve.engine.cache_pool import copy_kv_rows
from splitserve.engine.cache_spec import CachePlan
from splitserve.engine.model.kimi_linear import LayerCaches
from splitserve.engine.prefix_cache.block_pool import CachingBlockAllocator
from splitserve.engine.prefix_cache.chain import Naming
from splitserve.engine.prefix_cache.events import PrefixEvent
from splitserve.engine.prefix_cache.imported import ImportedPrefix
from splitserve.engine.prefix_cache.match import Hit, find_hit
from splitserve.engine.prefix_cache.retained import RetainedPrefix
from splitserve.engine.prefix_cache.retention import RetentionPolicy, SeenSketch
from splitserve.engine.prefix_cache.snapshot_pool import SnapshotPool
from splitserve.engine.prefix_cache.stats import PrefixCacheStats
from splitserve.engine.request import Request
from splitserve.engine.state_transfer import cache_for, extract_kda, extract_mla_rows, token_rows, write_piece
from splitserve.engine_config import EngineConfig
from splitserve.state import StateKind

logger = logging.getLogger(__name__)


@dataclass
class _Snapshot:
    num_tokens: int
    deps: list[bytes]  # the KV entries it needs (its whole units, then its tail if any)
    event_hash: bytes | None  # the name its `stored`/`removed` events carry
    published: bool  # handed to the retention listener (a local boundary is not, until kept again)


class PrefixCache:
    """Owns the KV index (through `CachingBlockAllocator`), the snapshot pool, the retention
    policy, the events and the counters. The scheduler calls it at admission (`admit`), to cut
    chunks (`clip_chunk`), after each step (`after_step`) and when a request finishes (`retain_end`).

    Promises: a hit is reported only where every MLA layer's KV and a snapshot at exactly that
    boundary exist (a snapshot whose KV is evicted goes with it); shared blocks are never written
    (a hit ending inside a block copies that block); a hit copies its snapshot into the request's
    own slot before the request extends it.
    """

    def __init__(
        self,
        caches: LayerCaches,
        blocks: CachingBlockAllocator,
        num_snapshots: int,
        *,
        block_size: int,
        unit: int,
        interval: int,
        selective: bool,
        salt: bytes = b"",
    ) -> None:
        self.caches = caches
        self.blocks = blocks
        self.block_size = block_size
        self.naming = Naming(unit, salt)
        self.snapshots = SnapshotPool(caches, num_snapshots)
        self.policy = RetentionPolicy(unit, interval, selective, SeenSketch())
        self.stats = PrefixCacheStats()
        self.listener: Callable[[RetainedPrefix], None] | None = None
        # False: the listener gets KDA states only (a tensor-parallel rank > 0: rank 0 has the MLA rows)
        self.listener_wants_mla = True
        self._snaps: dict[bytes, _Snapshot] = {}
        self._dependents: dict[bytes, set[bytes]] = {}  # KV key -> snapshots needing it
        self._tails: dict[bytes, dict[int, int]] = {}  # parent key -> {tail length: entries}
        self._tail_of: dict[bytes, tuple[bytes, int]] = {}  # tail KV key -> (parent, length)
        self._event_counts: dict[bytes, int] = {}
        self._events: list[PrefixEvent] = []
        blocks.on_evict = self._kv_evicted
        self.snapshots.on_evict = self._snapshot_evicted

    @property
    def unit(self) -> int:
        return self.naming.unit

    # ---- requests --------------------------------------------------------------------------

    def check_request(
        self, request: Request, prefix_hashes: list[bytes] | None, imported: ImportedPrefix | None
    ) -> None:
        """Validate what `add_request` was given; ValueError naming what does not fit."""
        if prefix_hashes is not None:
            # the prompt's whole units, or (a resumed request) those of prompt + given output tokens
            want = {request.num_prompt_tokens // self.unit, request.num_input_tokens // self.unit}
            if len(prefix_hashes) not in want:
                raise ValueError(
                    f"prefix_hashes has {len(prefix_hashes)} names; a prompt of {request.num_prompt_tokens} "
                    f"tokens has {min(want)} whole units of {self.unit} (hash with cache.prefix_unit)"
                )
            request.prefix_hashes = list(prefix_hashes)
        if imported is None:
            return
        n, start = imported.num_tokens, imported.token_start
        if not 0 < n <= request.num_prompt_tokens:
            raise ValueError(f"imported prefix has {n} tokens; the prompt has {request.num_prompt_tokens}")
        if not 0 <= start < n:
            raise ValueError(f"imported prefix starts at token {start}; it must be in [0, {n})")
        chain = self.naming.chain(request, n)
        if imported.hash_chain != chain[: n // self.unit]:
            raise ValueError(
                "imported prefix's hash_chain does not name this prompt's first tokens "
                "(another prompt, or another salt or prefix unit)"
            )
        rows: dict[int, int] = {}
        kda: set[tuple[int, StateKind]] = set()
        for state in imported.states:
            cache_for(self.caches, state)  # shape and dtype
            if state.kind is StateKind.MLA_KV:
                if not start <= state.token_start < state.token_end <= n:
                    raise ValueError(
                        f"imported prefix's layer {state.layer_id} piece covers [{state.token_start}, "
                        f"{state.token_end}), outside its rows [{start}, {n})"
                    )
                rows[state.layer_id] = rows.get(state.layer_id, 0) + state.token_end - state.token_start
            else:
                kda.add((state.layer_id, StateKind(state.kind)))
        missing = [lid for lid in self.caches.mla_kv if rows.get(lid) != n - start]
        missing += [
            lid
            for lid in self.caches.kda_conv
            if {(lid, StateKind.KDA_CONV), (lid, StateKind.KDA_RECURRENT)} - kda
        ]
        if missing:
            raise ValueError(f"imported prefix of {n} tokens is incomplete in layers {sorted(set(missing))}")
        request.imported_prefix = imported

    def admit(self, request: Request) -> None:
        """Start a request just given its slot from the longest hit (local or imported), and plan
        its snapshots. The scheduler reserves the blocks of its first chunk next, then calls
        `confirm` (or releases the request, which may be admitted again later)."""
        st = self.naming.state(request)
        limit = request.num_tokens - 1  # a sample needs the last token computed here
        chain = self.naming.chain(request, limit)
        match = find_hit(self, request, chain, limit)
        hit = match.hit
        num_hit = hit.num_tokens if hit is not None and self._apply(request, hit) else 0
        imported = request.imported_prefix
        request.imported_prefix = None  # used now or never (kept locally once scattered)
        st.pending = (num_hit, 0, match.kv_tokens)
        # a delta import needs the local hit it extends (all or nothing: if that was evicted
        # meanwhile, the request computes from what is still local)
        usable = imported is not None and imported.token_start <= num_hit < imported.num_tokens <= limit
        if usable and imported is not None and self._import(request, imported, num_hit):
            st.pending = (num_hit, imported.num_tokens - num_hit, match.kv_tokens)
            num_hit = imported.num_tokens
        input_end = request.num_input_tokens
        input_chain = self.naming.chain(request, input_end)
        shared = self.policy.plan(
            input_chain,
            num_hit,
            input_end,
            lambda key: key in self.blocks.index,
            first_admission=not st.admitted,
        )
        # the same input again hits here; a local snapshot only: publishing it too would double
        # each prompt's bytes in the store for a prefix the router sends to this engine anyway
        pre_end = self.policy.pre_end(num_hit, input_end)
        st.local_boundary = pre_end if pre_end not in shared else None
        st.boundaries = sorted({*shared, *([] if pre_end is None else [pre_end])})

    def confirm(self, request: Request) -> None:
        """The request was admitted with its first chunk's blocks: count its first admission."""
        st = self.naming.state(request)
        if st.admitted:
            return
        st.admitted = True
        local, imported, kv_tokens = st.pending
        s = self.stats
        s.num_queried_tokens += request.num_input_tokens
        s.num_hit_tokens += local
        s.num_imported_tokens += imported
        s.num_lost_to_missing_state_tokens += max(0, kv_tokens - local - imported)
        request.num_cached_tokens = min(local + imported, request.num_prompt_tokens)
        self.policy.record(self.naming.chain(request, request.num_input_tokens))

    def _apply(self, request: Request, hit: Hit) -> bool:
        """Share the hit's whole blocks, copy its partial last block, load its snapshot."""
        assert request.state_slot is not None and not request.block_table
        bs = self.block_size
        ids: list[int] = []
        for key in hit.kv_keys:
            ids.extend(self.blocks.index[key].block_ids)
            self.blocks.touch(key)
        num_full = hit.num_tokens // bs
        shared, partial = ids[:num_full], ids[num_full] if hit.num_tokens % bs else None
        self.blocks.share(shared)
        request.block_table = list(shared)
        if partial is not None:
            self.blocks.share([partial])  # held while allocating, so eviction cannot reuse it
            got = self.blocks.allocate(1)
            if got is not None:
                copy_kv_rows(self.caches, partial, got[0], hit.num_tokens % bs, bs)
                request.block_table.append(got[0])
            self.blocks.free([partial])
            if got is None:
                self.blocks.free(request.block_table)
                request.block_table = []
                return False
        # only now: a request that falls back to computing from 0 must keep its zeroed slot
        self.snapshots.load(hit.snapshot_key, request.state_slot)
        request.num_computed_tokens = hit.num_tokens
        return True

    def _import(self, request: Request, imported: ImportedPrefix, num_hit: int) -> bool:
        """Scatter an imported prefix into the request's blocks and slot, then keep it like our own.
        Over a local hit of `num_hit` tokens (at least the import's `token_start`) the hit's blocks
        stay (shared ones, and its private copy of a partial last block) and only the rows past
        it are written, into that private block and new ones: shared blocks are never written."""
        assert request.state_slot is not None
        n, bs = imported.num_tokens, self.block_size
        got = self.blocks.allocate(-(-n // bs) - len(request.block_table))
        if got is None:
            return False  # the local hit, if any, stays as applied
        request.block_table = request.block_table + got
        if num_hit > imported.token_start:
            imported = imported.delta_from(num_hit)  # rows the local hit holds already are not rewritten
        rows = token_rows(request.block_table, n, bs)
        for state in imported.states:
            write_piece(self.caches, state, rows, request.state_slot)
        request.num_computed_tokens = n
        self.retain(request, n, notify=False)  # the listener's store has it already
        return True

    def clip_chunk(self, request: Request, num_new: int) -> int:
        """Cut a chunk at the next planned snapshot boundary."""
        st = request.cache_state
        if st is None:
            return num_new
        start = request.num_computed_tokens
        ahead = [b for b in st.boundaries if b > start]
        return min(num_new, ahead[0] - start) if ahead else num_new

    def after_step(self, requests: list[Request]) -> None:
        """Index the whole units the step completed and take the snapshots it reached."""
        for request in requests:
            if request.finished or request.state_slot is None:
                continue
            st = self.naming.state(request)
            self._publish(request, request.num_computed_tokens)
            n = request.num_computed_tokens
            if n in st.boundaries:
                st.boundaries = [b for b in st.boundaries if b > n]
                self.retain(request, n, local=n == st.local_boundary)

    def retain_end(self, request: Request) -> None:
        """A request is finishing: keep the state of everything it computed (prompt + reply)."""
        if request.state_slot is not None and request.num_computed_tokens > 0:
            self.retain(request, request.num_computed_tokens)

    def _publish(self, request: Request, num_tokens: int) -> None:
        st, unit = self.naming.state(request), self.unit
        chain = self.naming.chain(request, num_tokens)
        per_unit = unit // self.block_size
        for u in range(st.num_published_units, num_tokens // unit):
            self.blocks.insert(chain[u], request.block_table[u * per_unit : (u + 1) * per_unit], unit)
        st.num_published_units = max(st.num_published_units, num_tokens // unit)

    # ---- retention ---------------------------------------------------------------------------

    def retain(self, request: Request, n: int, notify: bool = True, local: bool = False) -> None:
        """Keep the request's state at `n` computed tokens: its KV (units and tail) and a snapshot.
        The retention listener gets a copy once: now, unless `local` (for this engine only, until
        it is kept again without) or not `notify` (the listener's store has it already)."""
        assert request.state_slot is not None
        self._publish(request, n)
        chain = self.naming.chain(request, n)
        whole, tail = divmod(n, self.unit)
        key = self.naming.key(request, n)
        deps = list(chain[:whole])
        if tail:
            first = whole * self.unit // self.block_size
            blocks = request.block_table[first : -(-n // self.block_size)]
            if self.blocks.insert(key, blocks, tail):
                parent = self.naming.parent(chain, whole)
                self._tail_of[key] = (parent, tail)
                lengths = self._tails.setdefault(parent, {})
                lengths[tail] = lengths.get(tail, 0) + 1
            deps.append(key)
        snap = self._snaps.get(key)
        if snap is not None:
            self.snapshots.save(key, request.state_slot)  # only touched
        else:
            if any(d not in self.blocks.index for d in deps):
                return
            if not self.snapshots.save(key, request.state_slot):
                return
            snap = self._snaps[key] = _Snapshot(n, deps, chain[whole - 1] if whole else None, not notify)
            for d in deps:
                self._dependents.setdefault(d, set()).add(key)
            self._count_event(snap.event_hash, n, +1)
        if not (local or snap.published) and self.listener is not None:
            snap.published = True
            self.listener(self._retained(request, chain[:whole], n))

    def _retained(self, request: Request, chain: list[bytes], n: int) -> RetainedPrefix:
        assert request.state_slot is not None
        rows = token_rows(request.block_table, n, self.block_size)
        mla = self.caches.mla_kv if self.listener_wants_mla else {}
        states = [extract_mla_rows(self.caches, lid, rows, 0, n) for lid in mla]
        for lid in self.caches.kda_conv:
            states.extend(extract_kda(self.caches, lid, request.state_slot, n))
        tail = [request.token_at(p) for p in range(len(chain) * self.unit, n)]
        return RetainedPrefix(list(chain), n, tail, states)

    def _count_event(self, name: bytes | None, n: int, delta: int) -> None:
        if name is None:
            return
        count = self._event_counts.get(name, 0) + delta
        if count > 0:
            self._event_counts[name] = count
        else:
            self._event_counts.pop(name, None)
        if (delta > 0 and count == 1) or count == 0:
            self._events.append(PrefixEvent("stored" if delta > 0 else "removed", name, n))

    # ---- eviction ----------------------------------------------------------------------------

    def _kv_evicted(self, key: bytes) -> None:
        self.stats.num_evictions += 1
        tail = self._tail_of.pop(key, None)
        if tail is not None:
            lengths = self._tails[tail[0]]
            lengths[tail[1]] -= 1
            if not lengths[tail[1]]:
                del lengths[tail[1]]
            if not lengths:
                del self._tails[tail[0]]
        for snap in self._dependents.pop(key, set()):
            if snap in self.snapshots:
                self.snapshots.evict(snap)  # a snapshot without all its KV is never a hit

    def _snapshot_evicted(self, key: bytes) -> None:
        self.stats.num_evictions += 1
        info = self._snaps.pop(key)
        for d in info.deps:
            dependents = self._dependents.get(d)
            if dependents is not None:
                dependents.discard(key)
                if not dependents:
                    del self._dependents[d]
        self._count_event(info.event_hash, info.num_tokens, -1)

    def tail_lengths(self, parent: bytes) -> list[int]:
        """Lengths of the kept tails (boundaries inside a unit) after the prefix `parent`, longest first."""
        return sorted(self._tails.get(parent, {}), reverse=True)

    def take_events(self) -> list[PrefixEvent]:
        events, self._events = self._events, []
        return events

    def current_stats(self) -> PrefixCacheStats:
        s = self.stats
        s.num_snapshots, s.snapshot_bytes = len(self.snapshots), self.snapshots.used_bytes
        return PrefixCacheStats(**vars(s))


def make_prefix_cache(config: EngineConfig, plan: CachePlan, caches: LayerCaches) -> PrefixCache | None:
    """The prefix cache `config` asks for over `caches` (None when caching is off)."""
    if not config.enable_prefix_caching:
        return None
    if plan.num_snapshots == 0:
        logger.warning(
            "prefix caching is on but snapshot_memory_bytes=%d holds no KDA snapshot (%d B each): "
            "nothing can hit; raise cache.snapshot_memory_bytes",
            config.snapshot_memory_bytes,
            plan.slot_bytes,
        )
    return PrefixCache(
        caches,
        CachingBlockAllocator(plan.num_blocks),
        plan.num_snapshots,
        block_size=config.block_size,
        unit=config.prefix_unit,
        interval=config.retention_interval,
        selective=config.selective_retention,
        salt=config.prefix_salt.encode(),
    )
