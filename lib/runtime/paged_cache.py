"""Paged storage of every sequence's decode state (DSV4-REFERENCE §3.12; L19, B12-B14).

A sequence's dense state (lib/records/decode_state.py) at committed length L is a pure function of L and
append-only rows keyed by position: raw KV by token position (the window is [L-W, L)), each
compressor's per-position A and Z+ape rows, and compressed entries by entry index. `views`
rebuilds the dense records bit for bit; `write` stores what a step produced without committing,
so rejecting drafts is only lowering L. Slot mapping is backends/common/paging.py; block geometry
comes from the backend profile. Knows no scheduler and no request.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import torch

import backends.common.paging as paging
from lib.runtime.loaded_model import new_cache
from lib.records.decode_state import CompressorState, LayerCache, SeqCache


class CacheFull(RuntimeError):
    """Not enough free blocks; nothing was allocated."""


class Group(NamedTuple):
    name: str          # "tokens" or "c{m}"
    ratio: int         # 0: keyed by token position; m: keyed by compressed position (entry index)
    num_blocks: int    # physical blocks of its pools


class GroupMeta(NamedTuple):
    """One sequence's metadata in one group: what the attention kernel is handed."""
    group: Group
    table: torch.Tensor   # [n_logical] int32 logical block ids; -1 where released
    length: int           # positions of this group the sequence holds: L, or L // m
    released: int         # positions below this lie in released blocks (never read)


class Pool(NamedTuple):
    group: str
    rows: torch.Tensor        # [num_blocks * block_tokens, dim]
    horizon: int | None       # positions below L - horizon are never read again; None: all are


def group_length(group: Group, length: int) -> int:
    return length if group.ratio == 0 else length // group.ratio


def group_positions(group: Group, start: int, end: int) -> torch.Tensor:
    """The positions of `group` [k] int64 written by tokens [start, end): the tokens themselves, or
    for a compressed group the entries they complete, [start // m, end // m) — compressed
    positions (entry indices), never raw token positions (B13)."""
    if group.ratio == 0:
        return torch.arange(start, end, dtype=torch.int64)
    return torch.arange(start // group.ratio, end // group.ratio, dtype=torch.int64)


def group_of(metas: Sequence[GroupMeta], ratio: int) -> GroupMeta:
    """The metadata a layer reads for its rows keyed by `ratio` (0: token positions; m: its
    compressed entries), picked by the layer's ratio, never by list position (B14)."""
    for meta in metas:
        if meta.group.ratio == ratio:
            return meta
    raise ValueError(f"no cache group of ratio {ratio} (groups: {', '.join(m.group.name for m in metas)})")


class PagedSites(NamedTuple):
    """The paged cache's address arithmetic, passed in explicitly (a cache is built with the correct
    functions; conformance passes field bugs B12-B14 through here)."""
    physical_slots: Callable = paging.physical_slots    # block table -> physical rows (L19)
    group_positions: Callable = group_positions         # positions -> slots within a group
    group_of: Callable = group_of                       # a layer's cache group metadata


@dataclass
class _Seq:
    tables: dict[str, list[int]]    # group -> logical block ids (-1: released)
    length: int = 0                 # committed positions
    written: int = 0                # end of the last write; positions [length, written) are uncommitted
    kv_from: int = 0                # window rows are stored for positions [kv_from, written)
    released: int = 0               # tokens-group positions below this are in released blocks


class PagedCache:
    """Block pools for every layer's decode state and the per-sequence block tables.

    Groups: "tokens" (num_blocks blocks) and "c{m}" per distinct backbone ratio m, sized
    cdiv(num_blocks, m) + max_seqs: live positions fill at most num_blocks blocks, whose entries
    fill num_blocks / m blocks, plus one partly filled block per sequence. `release_old` recycles
    tokens blocks while entries stay, so long sequences can fill a compressed group first;
    `ensure` then raises CacheFull like for any other group.
    """

    def __init__(self, model, geometry, num_blocks: int, *, max_seqs: int, sites: PagedSites = PagedSites()):
        """`model`: a loaded model or anything with its `cfg`, `state_dtype` and backbone `layers`;
        `geometry`: `block_tokens` and `logical_block_tokens` (the model's `facts`)."""
        self.cfg, self.state_dtype, self.layers, self.sites = model.cfg, model.state_dtype, model.layers, sites
        self.geometry, self.max_seqs = geometry, max_seqs
        self.block_tokens, self.logical_block_tokens = geometry.block_tokens, geometry.logical_block_tokens
        self.factor = self.block_tokens // self.logical_block_tokens
        ratios = sorted({layer.ratio for layer in self.layers if layer.ratio})
        self.groups = [Group("tokens", 0, num_blocks)] + [
            Group(f"c{m}", m, -(-num_blocks // m) + max_seqs) for m in ratios]
        self._alloc = {g.name: paging.BlockAllocator(g.num_blocks) for g in self.groups}
        self._pools: dict[str, Pool] = {}
        self._seqs: dict[object, _Seq] = {}
        self._empty = new_cache(self.layers, self.cfg, self.state_dtype)     # shapes and dtypes of the dense path
        window = self.cfg.sliding_window
        for layer, empty in zip(self.layers, self._empty.layers):
            self._add(f"layer{layer.index}.kv", "tokens", empty.window, window)
            for name, st in (("comp", empty.comp), ("index", empty.index)):
                if st is None:
                    continue
                # buffered rows reach back one window, the CSA overlap one more (§3.7)
                reach = 2 * layer.ratio if layer.attention == "csa" else layer.ratio
                self._add(f"layer{layer.index}.{name}.kv", "tokens", st.buf_kv, reach)
                self._add(f"layer{layer.index}.{name}.gate", "tokens", st.buf_gate, reach)
                self._add(f"layer{layer.index}.{name}.entries", f"c{layer.ratio}", st.entries, None)

    @classmethod
    def for_model(cls, model, *, num_blocks: int, max_seqs: int, sites: PagedSites = PagedSites()) -> PagedCache:
        """Pools in the model's state dtype with its backend's block geometry."""
        return cls(model, model.facts, num_blocks, max_seqs=max_seqs, sites=sites)

    # ---- pools -------------------------------------------------------------------------------
    def _add(self, kind: str, group: str, like: torch.Tensor, horizon: int | None) -> None:
        if kind in self._pools:
            raise ValueError(f"cache rows '{kind}' already exist")
        blocks = next(g.num_blocks for g in self.groups if g.name == group)
        rows = torch.zeros(blocks * self.block_tokens, like.shape[1], dtype=like.dtype)
        self._pools[kind] = Pool(group, rows, horizon)

    def add_rows(self, kind: str, dim: int, dtype: torch.dtype, *, horizon: int | None) -> torch.Tensor:
        """A position-keyed pool in the tokens group (e.g. "draft.0" for a drafter stage's ring);
        `horizon`: how far below the committed length it is read (None: everything)."""
        self._add(kind, "tokens", torch.zeros(0, dim, dtype=dtype), horizon)
        return self._pools[kind].rows

    def rows(self, kind: str) -> torch.Tensor:
        """The pool of `kind` [num_blocks * block_tokens, dim]."""
        if kind not in self._pools:
            raise KeyError(f"no cache rows '{kind}' (have: {', '.join(self._pools)})")
        return self._pools[kind].rows

    def read_rows(self, kind: str, seq_id, lo: int, hi: int) -> torch.Tensor:
        """Rows of positions [lo, hi) of `kind` (in its group's positions) -> [hi - lo, dim]."""
        return self._read(kind, self._meta_of(seq_id, kind), lo, hi)

    def write_rows(self, kind: str, seq_id, start: int, values: torch.Tensor) -> None:
        """Store values [n, dim] at positions [start, start + n) of `kind`; ensure() them first."""
        meta = self._meta_of(seq_id, kind)
        if start < meta.released:
            raise RuntimeError(f"cache rows '{kind}': position {start} lies in a released block "
                               f"(released below {meta.released})")
        self._write(kind, meta, torch.arange(start, start + values.shape[0], dtype=torch.int64), values)

    def _meta_of(self, seq_id, kind: str) -> GroupMeta:
        self.rows(kind)                                   # a clear error for an unknown kind
        return next(m for m in self._metas(self._seq(seq_id)) if m.group.name == self._pools[kind].group)

    def _read(self, kind: str, meta: GroupMeta, lo: int, hi: int) -> torch.Tensor:
        if hi < lo:
            raise ValueError(f"cache rows '{kind}': positions [{lo}, {hi}) are not a range (hi < lo)")
        if hi > lo and lo < meta.released:
            raise RuntimeError(f"cache rows '{kind}': position {lo} lies in a released block "
                               f"(released below {meta.released})")
        if hi > meta.table.shape[0] * self.logical_block_tokens:
            raise IndexError(f"cache rows '{kind}': position {hi - 1} is beyond the "
                             f"{meta.table.shape[0] * self.logical_block_tokens} positions of group "
                             f"'{meta.group.name}' allocated to the sequence")
        q = torch.arange(lo, hi, dtype=torch.int64)
        slots = self.sites.physical_slots(meta.table, q, self.block_tokens, self.logical_block_tokens)
        return self._pools[kind].rows.index_select(0, slots)

    def _write(self, kind: str, meta: GroupMeta, positions: torch.Tensor, values: torch.Tensor) -> None:
        pool = self._pools[kind].rows
        if values.dtype != pool.dtype or values.dim() != 2 or values.shape[1] != pool.shape[1]:
            raise ValueError(f"cache rows '{kind}': cannot store {values.dtype} {list(values.shape)} in a "
                             f"{pool.dtype} pool of width {pool.shape[1]}")
        slots = self.sites.physical_slots(meta.table, positions, self.block_tokens, self.logical_block_tokens)
        with torch.no_grad():
            pool.index_copy_(0, slots, values)

    # ---- dense records <-> rows --------------------------------------------------------------
    def views(self, seq_ids) -> list[SeqCache]:
        """The dense state of each sequence at its committed length, rebuilt from the pools."""
        return [self._view(self._seq(s)) for s in seq_ids]

    def _view(self, seq: _Seq) -> SeqCache:
        metas, layers = self._metas(seq), []
        for layer, empty in zip(self.layers, self._empty.layers):
            tok, name = self.sites.group_of(metas, 0), f"layer{layer.index}"
            window = self._read(f"{name}.kv", tok, max(0, tok.length - self.cfg.sliding_window), tok.length)
            comp = index = None
            if empty.comp is not None:
                own = self.sites.group_of(metas, layer.ratio)
                comp = self._compressor(f"{name}.comp", tok, own, layer, empty.comp)
                if empty.index is not None:
                    index = self._compressor(f"{name}.index", tok, own, layer, empty.index)
            layers.append(LayerCache(window, comp, index))
        return SeqCache(seq.length, tuple(layers))

    def _compressor(self, kind: str, tok: GroupMeta, own: GroupMeta, layer, empty: CompressorState):
        """buf = rows [E*m, L); CSA prev = "a" half of rows [(E-1)*m, E*m); entries [0, E)."""
        m, n_entries = layer.ratio, own.length
        done = n_entries * m
        prev_kv, prev_gate = empty.prev_kv, empty.prev_gate
        if layer.attention == "csa" and n_entries:
            half = empty.prev_kv.shape[1]
            prev_kv = self._read(f"{kind}.kv", tok, done - m, done)[:, :half]
            prev_gate = self._read(f"{kind}.gate", tok, done - m, done)[:, :half]
        return CompressorState(self._read(f"{kind}.kv", tok, done, tok.length),
                               self._read(f"{kind}.gate", tok, done, tok.length), prev_kv, prev_gate,
                               self._read(f"{kind}.entries", own, 0, n_entries), empty.rows_kv, empty.rows_gate)

    def write(self, seq_ids, starts, seq_lens, new_caches: list[SeqCache]) -> None:
        """Store the rows of positions [start, start + n) from the records a step returned,
        without committing: the caller commits with set_length (a verify commits fewer)."""
        window = self.cfg.sliding_window
        for seq_id, start, n, cache in zip(seq_ids, starts, seq_lens, new_caches, strict=True):
            seq, end = self._seq(seq_id), start + n
            if start != seq.length or cache.length != end:
                raise ValueError(f"sequence {seq_id!r}: a write must continue its committed length {seq.length} "
                                 f"(got start {start}, record length {cache.length}, {n} new positions)")
            if any(self._needed(seq, end).values()):
                raise ValueError(f"sequence {seq_id!r}: positions < {end} are not allocated; ensure() them first")
            metas, keep = self._metas(seq), min(n, window)
            for layer, lc in zip(self.layers, cache.layers):
                tok, name = self.sites.group_of(metas, 0), f"layer{layer.index}"
                self._write(f"{name}.kv", tok, self.sites.group_positions(tok.group, end - keep, end),
                            lc.window[lc.window.shape[0] - keep:])
                for part, st in (("comp", lc.comp), ("index", lc.index)):
                    if st is None:
                        continue
                    if st.rows_kv.shape[0] != n:
                        raise ValueError(f"sequence {seq_id!r} {name}.{part}: the record carries "
                                         f"{st.rows_kv.shape[0]} per-position compressor rows for {n} new "
                                         f"positions (a compress op without rows_kv/rows_gate?)")
                    own, m = self.sites.group_of(metas, layer.ratio), layer.ratio
                    self._write(f"{name}.{part}.kv", tok, self.sites.group_positions(tok.group, start, end), st.rows_kv)
                    self._write(f"{name}.{part}.gate", tok, self.sites.group_positions(tok.group, start, end), st.rows_gate)
                    self._write(f"{name}.{part}.entries", own, self.sites.group_positions(own.group, start, end),
                                st.entries[start // m:end // m])
            seq.written = end
            if keep < n:             # a chunk longer than the window stores only its last W KV rows
                seq.kv_from = end - keep

    # ---- sequences and blocks ----------------------------------------------------------------
    def add(self, seq_id) -> None:
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already in the cache")
        if len(self._seqs) >= self.max_seqs:
            raise CacheFull(f"cannot add sequence {seq_id!r}: the cache holds its maximum of {self.max_seqs}")
        self._seqs[seq_id] = _Seq({g.name: [] for g in self.groups})

    def _seq(self, seq_id) -> _Seq:
        if seq_id not in self._seqs:
            raise KeyError(f"sequence {seq_id!r} is not in the cache (add it first)")
        return self._seqs[seq_id]

    def length(self, seq_id) -> int:
        return self._seq(seq_id).length

    def _needed(self, seq: _Seq | None, length: int) -> dict[str, int]:
        """New physical blocks per group so that positions < length are addressable."""
        out = {}
        for g in self.groups:
            held = len(seq.tables[g.name]) // self.factor if seq is not None else 0
            out[g.name] = max(0, -(-group_length(g, length) // self.block_tokens) - held)
        return out

    def can_fit(self, seq_ids_and_lengths) -> bool:
        total = {g.name: 0 for g in self.groups}
        for seq_id, length in seq_ids_and_lengths:
            for name, n in self._needed(self._seqs.get(seq_id), length).items():
                total[name] += n
        return all(total[name] <= self._alloc[name].free for name in total)

    def ensure(self, seq_id, length: int) -> None:
        """Allocate so positions < length are addressable in every group, all or nothing."""
        seq = self._seq(seq_id)
        need = self._needed(seq, length)
        short = [f"{n} {name} blocks ({self._alloc[name].free} of {self._alloc[name].num_blocks} free)"
                 for name, n in need.items() if n > self._alloc[name].free]
        if short:
            raise CacheFull(f"sequence {seq_id!r} needs {', '.join(short)} to hold {length} positions; "
                            f"nothing was allocated")
        for name, n in need.items():
            for block in self._alloc[name].take(n):
                seq.tables[name] += paging.logical_ids(block, self.block_tokens, self.logical_block_tokens)

    def _metas(self, seq: _Seq) -> list[GroupMeta]:
        return [GroupMeta(g, torch.tensor(seq.tables[g.name], dtype=torch.int32), group_length(g, seq.length),
                          seq.released if g.ratio == 0 else 0) for g in self.groups]

    @property
    def horizon(self) -> int | None:
        """Tokens-group positions below L - horizon are never read (None: all are)."""
        reach = [p.horizon for p in self._pools.values() if p.group == "tokens"]
        return None if None in reach else max(reach)

    def set_length(self, seq_id, length: int) -> None:
        """Commit (or rewind to) `length` positions; only positions already written count."""
        seq, window = self._seq(seq_id), self.cfg.sliding_window
        if not 0 <= length <= seq.written:
            raise ValueError(f"sequence {seq_id!r}: cannot commit length {length}: positions [0, {seq.written}) "
                             f"are written")
        if length and max(0, length - window) < seq.kv_from:
            raise ValueError(f"sequence {seq_id!r}: cannot commit length {length}: its window needs KV rows from "
                             f"position {max(0, length - window)}, but a chunk longer than the window stored rows "
                             f"from {seq.kv_from} only")
        if seq.released and (self.horizon is None or length - self.horizon < seq.released):
            raise ValueError(f"sequence {seq_id!r}: cannot rewind to {length}: positions below {seq.released} "
                             f"were released")
        seq.length = length

    def release_old(self, seq_id) -> int:
        """Free the tokens-group blocks that lie wholly below L - horizon; returns how many."""
        seq, horizon = self._seq(seq_id), self.horizon
        if horizon is None:
            return 0
        table, f, size = seq.tables["tokens"], self.factor, self.block_tokens
        k, freed = seq.released // size, []
        while (k + 1) * size <= seq.length - horizon and k * f < len(table):
            freed.append(table[k * f] // f)
            table[k * f:(k + 1) * f] = [-1] * f
            k += 1
        self._alloc["tokens"].give_back(freed)
        seq.released = k * size
        return len(freed)

    def free(self, seq_id) -> None:
        """Return every block of the sequence and forget it."""
        seq = self._seq(seq_id)
        for name, table in seq.tables.items():
            self._alloc[name].give_back(sorted({t // self.factor for t in table if t >= 0}))
        del self._seqs[seq_id]

    def usage(self) -> dict[str, tuple[int, int]]:
        """Group -> (used blocks, total blocks)."""
        return {g.name: (self._alloc[g.name].used, g.num_blocks) for g in self.groups}

    def row_bytes(self) -> dict[str, tuple[str, int]]:
        """Pool kind -> (its group, bytes one position or entry takes in it): what `dsv4gen plan`
        sizes caches with, so the planner and the engine share one layout."""
        return {kind: (p.group, p.rows.shape[1] * p.rows.element_size()) for kind, p in self._pools.items()}

    def bytes_per_block(self) -> dict[str, int]:
        """Group -> bytes one physical block takes over all its pools."""
        return {g.name: sum(self.block_tokens * p.rows.shape[1] * p.rows.element_size()
                            for p in self._pools.values() if p.group == g.name) for g in self.groups}
