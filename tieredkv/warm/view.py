"""PolicyView: one process's picture of the warm tier's eviction state, and the hits it has not written yet.

The warm tier's policy state is not shared: the records in the index hold each block's insert time, last
access and hit count, and every process rebuilds a private ``SlotState`` from them (``build``) when it
first needs a victim, then keeps it current with its own inserts, hits and removals. Others' stores
make it stale; ``choose_victims`` rebuilds it once when it is far behind or runs dry, and every victim
it proposes is re-checked against the index inside the write transaction (a stale view never evicts
the wrong block). Hits are noted here at once (memory only) and written into the records in batches by
``WarmTier._flush``: ``note_hits`` says when a batch is due.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tieredkv import policies
from tieredkv.errors import InvalidInput
from tieredkv.warm import index as ix

#: One batch of noted hits: raw 16-byte keys, their generations, slots and access times (µs).
Pending = tuple[bytes, np.ndarray, np.ndarray, np.ndarray]


class PolicyView:
    """The policy state of one process (see the module docstring).

    Args:
        policy: the eviction policy object.
        n_slots: the tier's slot count.
        rec: the index's record dtype (``n_slots`` and ``rec`` are set again once the tier is open).
        flush_every: noted hits after which a batch is due.
    """

    def __init__(self, policy, n_slots: int, rec: np.dtype | None, flush_every: int):
        self.policy, self.n_slots, self.rec, self.flush_every = policy, n_slots, rec, flush_every
        self.state: policies.SlotState | None = None
        self.gen = 0                       # the index generation the state was built at
        self.pending: list[Pending] = []   # hits noted and not written into the records yet
        self.pending_n = 0

    # ---- keeping the state current ------------------------------------------------------------
    def tick(self) -> None:
        # Ticks are wall-clock microseconds (never going back), so last_access values written by
        # different processes into the records compare meaningfully.
        st = self.state
        if st is not None:
            st.set_g("tick", max(st.g("tick"), ix.now_us()))

    def forget(self, slots: np.ndarray) -> None:
        """Slots this process freed (removed, evicted, dropped as damaged)."""
        if self.state is not None and len(slots):
            policies.remove(self.policy, self.state, slots)

    def inserted(self, slots: np.ndarray, key64: np.ndarray, parent_slots: np.ndarray,
                 positions: np.ndarray) -> None:
        """Blocks this process just committed."""
        if self.state is not None and len(slots):
            self.tick()
            policies.insert(self.policy, self.state, slots, key64, parent_slots, positions)

    def note_hits(self, raw: bytes, gens: np.ndarray, slots: np.ndarray) -> bool:
        """Record hits: in the state now, in the pending batch for the records. Returns whether a
        batch is due (``flush_every`` hits pending)."""
        n = len(gens)
        t = ix.now_us()
        slots_all = slots.astype(np.int64)
        st = self.state
        if st is not None:
            key64 = np.frombuffer(raw, dtype="<u8")[0::2].view(np.int64)
            live = slots_all[(st.resident[slots_all] == 1) & (st.key64[slots_all] == key64)]
            if len(live):
                self.tick()
                policies.hit(self.policy, st, live)
        self.pending.append((raw, gens.copy(), slots_all, np.full(n, t, dtype=np.int64)))
        self.pending_n += n
        return self.pending_n >= self.flush_every

    def take_pending(self) -> list[Pending]:
        """The pending hits, handed over for writing (the view keeps none)."""
        pending, self.pending, self.pending_n = self.pending, [], 0
        return pending

    def put_back(self, pending: list[Pending]) -> bool:
        """Keep hits a write could not make for the next try, unless that many are already waiting
        (bounded memory). Returns whether they were kept."""
        if self.pending_n >= 16 * self.flush_every:
            return False
        self.pending[:0] = pending
        self.pending_n += sum(len(p[1]) for p in pending)
        return True

    def pending_hits(self, raw: bytes, gens: np.ndarray) -> np.ndarray:
        """Hits noted for each (key, gen) and not written into the records yet."""
        out = np.zeros(len(gens), dtype=np.int64)
        if not self.pending or not len(gens):
            return out
        want = np.frombuffer(raw, dtype="V16")
        seen = np.frombuffer(b"".join(p[0] for p in self.pending), dtype="V16")
        seen_gens = np.concatenate([p[1] for p in self.pending])
        for i in range(len(want)):
            out[i] = int(np.count_nonzero((seen == want[i]) & (seen_gens == gens[i])))
        return out

    # ---- rebuilding it, choosing victims --------------------------------------------------------
    def build(self, txn, index) -> policies.SlotState:
        """Rebuild the state from the records (index only, no data): insert order, fields."""
        rec = self.rec
        if rec is None:
            raise InvalidInput("the warm tier's policy view is used before the tier is open")
        keys, vals = [], []
        for k, v in txn.cursor(db=index.blocks):
            if len(v) == rec.itemsize and np.frombuffer(v, dtype=rec, count=1)["slot"][0] < self.n_slots:
                keys.append(k)
                vals.append(v)
        st = policies.SlotState.private(self.policy, self.n_slots)
        self.state = st
        self.gen = ix.get_u64(txn, index.info, ix.INFO_GEN)
        if not keys:
            return st
        recs = np.frombuffer(b"".join(vals), dtype=rec)
        karr = np.frombuffer(b"".join(keys), dtype="<u8").reshape(-1, 2)
        order = np.argsort(recs["insert_us"], kind="stable")
        recs, karr = recs[order], karr[order]
        slots = recs["slot"].astype(np.int64)
        # Parent slot: look the parent key up among the stored keys (one sorted search).
        kv = np.ascontiguousarray(karr).view("V16").ravel()
        pv = np.ascontiguousarray(recs["parent"]).view("V16").ravel()
        sorter = np.argsort(kv)
        pos = np.minimum(np.searchsorted(kv, pv, sorter=sorter), len(kv) - 1)
        parents = np.where(kv[sorter[pos]] == pv, slots[sorter[pos]], -1)
        policies.insert(self.policy, st, slots, karr[:, 0], parents, recs["position"])
        st.last_access[slots] = recs["last_access_us"]
        st.insert_tick[slots] = recs["insert_us"]
        st.hits[slots] = recs["hits"]
        st.set_g("tick", max(int(recs["last_access_us"].max()), ix.now_us()))
        # Hits of this process not yet flushed to the records still count.
        for raw, _, pslots, ticks in self.pending:
            key64 = np.frombuffer(raw, dtype="<u8")[0::2].view(np.int64)
            live = (st.resident[pslots] == 1) & (st.key64[pslots] == key64)
            np.maximum.at(st.last_access, pslots[live], ticks[live])
            np.add.at(st.hits, pslots[live], 1)
        return st

    def choose_victims(self, txn, index, need: int,
                       delete_record: Callable) -> list[tuple[int, bytes, np.ndarray]]:
        """Evict up to ``need`` blocks chosen by the policy; return ``(slot, key, record)`` of each.

        Victims are re-checked inside the write transaction ``txn``: only a slot whose reverse entry
        and record (``delete_record(txn, key) -> (record, owned)`` removes it) still name the block the
        state thinks it holds is evicted. A state that runs dry or is far behind (others stored many
        blocks) is rebuilt once.
        """
        out: list[tuple[int, bytes, np.ndarray]] = []
        rebuilt = False
        if self.state is not None:
            gen = ix.get_u64(txn, index.info, ix.INFO_GEN)
            if gen - self.gen > max(16, self.n_slots // 4):
                self.state = None
        st = self.state
        if st is None:
            st = self.build(txn, index)
            rebuilt = True
        while len(out) < need:
            victims = policies.evict(self.policy, st, need - len(out))
            if not len(victims):
                if rebuilt:
                    break
                st = self.build(txn, index)
                rebuilt = True
                continue
            for s in victims.tolist():
                key = txn.get(ix.slot_key(s), db=index.slots)
                if key is None or np.frombuffer(key, dtype="<u8")[0].view(np.int64) != st.key64[s]:
                    continue  # stale view: that slot no longer holds the block we chose
                rec, owned = delete_record(txn, key)
                if rec is None or not owned or int(rec["slot"]) != s:
                    continue  # a damaged record: dropped, its slot left to `verify --repair`
                out.append((s, key, rec))
        return out
