"""Where a batch's decode state lives: slots, block tables and slot mappings, all as tensors (L19, B12-B14).

A batch (lib/records/batch.py) carries one `Addressing` record. Fixed per-sequence state (windows,
compressor rings) lives in ring pools [max_seqs + 1, R, C]: a sequence owns slot `seq_slot[s]`,
position p sits in row p % R, and slot `trash` takes the writes nothing will read (the rows of a
chunk longer than the ring). Compressed entries live in block pools [blocks * P, C] addressed
through the sequence's block table of that ratio: table entries are LOGICAL block ids because the
attention kernel addresses blocks of `logical_block_tokens` positions, so one physical block of P
appears as f = P // l consecutive ids (310P: 32-token blocks as 16 logical blocks of 2).

The ops use only the functions here to turn (sequence, position) into pool rows; `PagedSites`
carries the three that field bugs got wrong, so conformance can pass B12-B14 through them.
Geometry and index arithmetic only: no allocation, no model, no request.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch


def physical_slots(table: torch.Tensor, seq: torch.Tensor, q: torch.Tensor, block_tokens: int,
                   logical_block_tokens: int) -> torch.Tensor:
    """Pool rows [k] int64 of entries q [k] int64 of sequences seq [k] under block tables [S, n] int32.

    logical = table[seq, q // l]; physical = logical // f; offset = (logical % f) * l + q % l;
    row = physical * P + offset. The factor f comes from the table geometry (P, l), never from
    request data (B12). Entries past a table or on its -1 padding (a batch-wide read of
    sequences of different lengths) land in block 0; the caller masks them."""
    factor = block_tokens // logical_block_tokens
    col = (q // logical_block_tokens).clamp(0, max(0, table.shape[1] - 1))
    logical = table[seq, col].clamp(min=0).to(torch.int64) if table.shape[1] else torch.zeros_like(q)
    physical = logical // factor
    offset = (logical % factor) * logical_block_tokens + q % logical_block_tokens
    return physical * block_tokens + offset


def entry_ids(ratio: int, start: int, end: int) -> torch.Tensor:
    """The entry indices [k] int64 that tokens [start, end) complete: [start // m, end // m) —
    compressed positions, never the raw positions of the tokens that emitted them (B13)."""
    return torch.arange(start // ratio, end // ratio, dtype=torch.int64)


class GroupTable(NamedTuple):
    ratio: int
    table: torch.Tensor      # [S, n] int32 logical block ids of each batch sequence, -1 padding


def group_of(tables: tuple[GroupTable, ...], ratio: int) -> GroupTable:
    """The block tables a layer reads for its entries, picked by the layer's ratio, never by list
    position (B14)."""
    for group in tables:
        if group.ratio == ratio:
            return group
    raise ValueError(f"no block table of ratio {ratio} (have: {', '.join(str(g.ratio) for g in tables)})")


def reused_pools(source, own):
    """The pools a V4.1 compressed layer that makes no KV of its own reads: its own window with the latest KV source's
    compressor and key pools, the same tensors, so it reads what the source wrote this step (V41-REFERENCE §3.5)."""
    return own._replace(comp=source.comp, index=source.index)


class PagedSites(NamedTuple):
    """The paged state's address arithmetic, passed in explicitly (the runtime builds batches with
    the correct functions; conformance passes field bugs B12-B14 through here)."""
    physical_slots: Callable = physical_slots    # block table -> pool rows (L19)
    entry_ids: Callable = entry_ids              # tokens -> the entries they complete
    group_of: Callable = group_of                # a layer's block tables
    reused_pools: Callable = reused_pools        # what a V4.1 layer after a KV source reads (its source's pools)


class EntryWrites(NamedTuple):
    """The compressed entries a step completes, for one ratio (each compressor of that ratio
    writes one row per entry)."""
    rows: torch.Tensor       # [K] int64 token row whose position completes the entry
    seq: torch.Tensor        # [K] int64 its batch sequence
    ids: torch.Tensor        # [K] int64 entry index within the sequence
    slots: torch.Tensor      # [K] int64 pool row it is written to


class StepShape(NamedTuple):
    """The static shapes of a bucketed step, a captured graph's inputs (lib/runtime/step_graph.py):
    `seqs` sequences (padded) of `tokens` new tokens each, reading at most `max_len` positions."""
    seqs: int
    tokens: int
    max_len: int


class Addressing(NamedTuple):
    row_seq: torch.Tensor             # [T] int64 batch sequence of each token row
    seq_slot: torch.Tensor            # [S] int64 each sequence's slot in the ring pools
    seq_start: torch.Tensor           # [S] int64 committed positions before this step
    seq_end: torch.Tensor             # [S] int64 start + new tokens
    seq_lo: torch.Tensor              # [S] int64 first token row of each sequence (cu_seqlens[:-1])
    tables: tuple[GroupTable, ...]    # one per entry ratio
    writes: dict                      # ratio -> EntryWrites of this step
    max_entries: dict                 # ratio -> entries of the longest sequence at seq_end (read shapes)
    trash: int                        # the ring slot that takes unread writes (= max_seqs)
    block_tokens: int
    logical_block_tokens: int
    sites: PagedSites = PagedSites()
    # this step's rows, built once for every layer (`with_step_rows`, on the host like vLLM's slot
    # mapping), not recomputed by each layer's ops: ("ring", R) [T], ("window", W, R) [T, W] and
    # ("window_mask", W) [T, W], ("span", m, n, R) [K, n] and ("span_pos", m, n) [K, n],
    # ("entries", m) [S, E + ENTRY_PAD]; for a paged attention kernel ("query_start",) [S + 1] and
    # ("seq_lens",) [S] int32 (cu_seqlens_q, seqused_kv) and ("window_table", R) [S, cdiv(max_len, R)]
    # int32 (a window ring of R rows read as one block of R rows per sequence); for the compressor kernel
    # ("start_pos",) [S] int32 and ("state_table", R) [S, cdiv(max_len, R)] int32; for an indexer kernel
    # that takes every token row as its own batch, ("row_ends",) [T] int32 (1..T) and ("row_table", m)
    # [T, n] int32 (each row's sequence's block table of ratio m)
    rows: dict = {}
    max_len: int = 0                  # positions the longest sequence reaches (a bucket: its max_len)
    step_tokens: int = 0              # most tokens one sequence feeds this step (host int: chooses kernels)

    # ---- entries (block pools) -------------------------------------------------------------
    def entry_rows(self, ratio: int, seq: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Pool rows [k] of entries ids [k] (clamped at 0; mask them yourself) of sequences seq [k]."""
        table = self.sites.group_of(self.tables, ratio).table
        return self.sites.physical_slots(table, seq, ids.clamp(min=0), self.block_tokens, self.logical_block_tokens)

    def seq_entries(self, ratio: int, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every entry of every batch sequence at its end: (pool rows [S, E], ids [S, E]) with
        E = width (default max_entries[ratio]); ids >= seq_end // ratio are padding (row 0)."""
        n, s = self.max_entries[ratio] if width is None else width, self.seq_slot.shape[0]
        dev = self.row_seq.device
        ids = torch.arange(n, dtype=torch.int64, device=dev).expand(s, n)
        seq = torch.arange(s, dtype=torch.int64, device=dev)[:, None].expand(s, n)
        return self.entry_rows(ratio, seq.reshape(-1), ids.reshape(-1)).view(s, n), ids

    # ---- this step's rows (built once, read by every layer) ---------------------------------
    def step(self, key: tuple) -> torch.Tensor:
        if key not in self.rows:
            raise KeyError(f"this step's addressing has no rows {key} (built: {sorted(self.rows)}); "
                           "PagedCache.address builds them for the model's pools")
        return self.rows[key]

    def entry_block(self, ratio: int, lo: int, n: int) -> torch.Tensor:
        """Pool rows [T, n] of entries lo..lo+n of each token row's sequence (past its last entry:
        row 0, masked by the caller); n <= ENTRY_PAD."""
        return self.step(("entries", ratio))[:, lo:lo + n].index_select(0, self.row_seq)

    def entry_rows_of(self, ratio: int, ids: torch.Tensor) -> torch.Tensor:
        """Pool rows [T, k] of entry ids [T, k] of each token row's sequence (ids < 0: row 0)."""
        flat = self.step(("entry_base", ratio)) + ids.clamp(min=0)                 # [T, 1] + [T, k]
        return self.step(("entries", ratio)).view(-1).index_select(0, flat.reshape(-1)).view(ids.shape)

    # ---- rings (per-sequence slots) --------------------------------------------------------
    def to(self, device) -> Addressing:
        """The same addresses with every tensor on `device` (host ints and functions stay)."""
        move = lambda t: t.to(device)
        return self._replace(row_seq=move(self.row_seq), seq_slot=move(self.seq_slot), seq_start=move(self.seq_start),
                             seq_end=move(self.seq_end), seq_lo=move(self.seq_lo),
                             tables=tuple(GroupTable(g.ratio, move(g.table)) for g in self.tables),
                             writes={m: EntryWrites(*(move(t) for t in w)) for m, w in self.writes.items()},
                             rows={k: move(t) for k, t in self.rows.items()})

    def ring_rows(self, seq: torch.Tensor, q: torch.Tensor, ring: int) -> torch.Tensor:
        """Rows [k] of positions q [k] of sequences seq [k] in a ring pool of `ring` rows per slot,
        viewed flat [(max_seqs + 1) * ring, C]."""
        return self.seq_slot[seq] * ring + q % ring

    def ring_writes(self, positions: torch.Tensor, ring: int) -> torch.Tensor:
        """Flat ring rows [T] for this step's token rows: a sequence's last `ring` positions go to
        its slot, earlier rows of a longer chunk (overwritten within the chunk anyway) to trash."""
        seq = self.row_seq
        keep = positions >= self.seq_end[seq] - ring
        return torch.where(keep, self.ring_rows(seq, positions, ring), self.trash * ring + positions % ring)

    def sources(self, seq: torch.Tensor, q: torch.Tensor, ring: int) -> torch.Tensor:
        """Rows [k] of positions q [k] (any shape) in cat(ring pool flat, this step's rows): a position
        this step feeds is its token row, an older one its ring row (read before the ring is written)."""
        fed = q >= self.seq_start[seq]
        new = (self.trash + 1) * ring + self.seq_lo[seq] + (q - self.seq_start[seq])
        return torch.where(fed, new, self.seq_slot[seq] * ring + q.clamp(min=0) % ring)


ENTRY_PAD = 1024     # columns past the last entry in a step's entry table: any read block fits (<= 1024 wide)


def with_step_rows(addr: Addressing, positions: torch.Tensor, *, window: int, window_rings: set[int],
                   rings: set[int], spans: set[tuple[int, int, int]]) -> Addressing:
    """`addr` with the rows every layer of this step reads, built once (host ops): the ring rows each
    token writes in rings of R rows, the window sources [T, W] of window pools of R rows, the
    sources [K, n] of the n positions pooled into each entry of ratio m completed this step
    (span (m, n, R)), and each sequence's entry rows of every ratio."""
    seq = addr.row_seq
    rows = {("ring", r): addr.ring_writes(positions, r) for r in sorted(rings | window_rings)}
    pos = positions[:, None] - window + 1 + torch.arange(window)
    rows[("window_mask", window)] = pos >= 0
    for r in sorted(window_rings):
        rows[("window", window, r)] = addr.sources(seq[:, None].expand_as(pos), pos, r)
    for m, n, r in sorted(spans):
        w = addr.writes[m]
        q = (w.ids * m - (n - m))[:, None] + torch.arange(n)
        rows[("span_pos", m, n)] = q
        rows[("span_valid", m, n)] = q >= 0
        rows[("span", m, n, r)] = addr.sources(w.seq[:, None].expand_as(q), q, r)
        rows[("phase", m)] = (positions % m).to(torch.int32)      # each token's slot in its window (ape row)
    for m in addr.max_entries:
        rows[("entries", m)] = addr.seq_entries(m, addr.max_entries[m] + ENTRY_PAD)[0]
        rows[("entry_base", m)] = addr.row_seq[:, None] * rows[("entries", m)].shape[1]   # each row's table offset
        rows[("limit", m)] = ((positions + 1) // m).to(torch.int32)     # entries each token row may read
    return addr._replace(rows=rows | kernel_rows(addr, window_rings, rings))


def kernel_rows(addr: Addressing, window_rings: set[int], rings: set[int] = frozenset()) -> dict:
    """The sequence metadata of vllm-ascend's paged kernels: cu_seqlens_q [S + 1], seqused_kv [S]
    (positions after this step) and start_pos [S] (before it) int32; per window ring of R rows, a block
    table [S, cdiv(max_len, R)] whose every entry is the sequence's slot: the attention kernel reads
    position x at row x % R of block table[s, x // R], which is where the ring keeps x; per compressor
    ring of R rows the same table of the slot + 1 (the compressor's state pool keeps an unused slot 0,
    lib/records/decode_state.py: its kernel never writes block 0)."""
    lens = (addr.seq_end - addr.seq_start).to(torch.int32)
    rows = {("query_start",): torch.cat((torch.zeros(1, dtype=torch.int32), lens.cumsum(0).to(torch.int32))),
            ("seq_lens",): addr.seq_end.to(torch.int32), ("start_pos",): addr.seq_start.to(torch.int32)}
    for r in sorted(window_rings):
        rows[("window_table", r)] = addr.seq_slot.to(torch.int32)[:, None].repeat(1, max(1, -(-addr.max_len // r)))
    for r in sorted(rings):
        rows[("state_table", r)] = (addr.seq_slot.to(torch.int32) + 1)[:, None].repeat(1, max(1, -(-addr.max_len // r)))
    rows[("row_ends",)] = torch.arange(1, addr.row_seq.shape[0] + 1, dtype=torch.int32)
    for group in addr.tables:
        rows[("row_table", group.ratio)] = group.table.index_select(0, addr.row_seq)
    return rows
