"""Paged decode state: the pools the generated forward reads and writes, and who owns which rows.

Every declared state item (spec/state.yaml, the model's `state`) becomes one pool per layer
(lib/runtime/state_pools.py). Fixed per-sequence state (windows, compressor rings, drafter rings)
sits in one of `max_seqs` slots; compressed entries and indexer keys sit in block pools, one
group per compress ratio, so memory grows with the compressed context only. A step's batch gets
an Addressing record (lib/records/addressing.py) naming slots, block tables and the entries it
completes; the ops scatter and gather through it. Writes happen in place during the forward and
commit nothing: rejecting drafts is only lowering the committed length, which the rings' `slack`
rows make safe. Knows no scheduler and no request.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lib.guard.capability import allow
from lib.records.addressing import Addressing, EntryWrites, GroupTable, PagedSites, StepShape, with_step_rows
from lib.records.batch import Batch, positions_of
from lib.records.decode_state import CompressorPools, LayerPools
from lib.runtime.block_allocator import BlockAllocator
from lib.runtime.engram_ids import Tail, as_tensor, step_ids
from lib.runtime.hostmem import mapped_zeros
from lib.runtime.state_pools import entry_ratios, group_blocks, pool_shapes


class CacheFull(RuntimeError):
    """Not enough free blocks or slots; nothing was allocated."""


@dataclass
class _Seq:
    slot: int
    tables: dict[int, list[int]] = field(default_factory=dict)   # ratio -> logical block ids
    length: int = 0         # committed positions
    written: int = 0        # end of the last write; [length, written) are uncommitted
    engram: Tail = Tail(0, ())   # compressed ids of the last written positions (a model with Engram layers)


class PagedCache:
    """Pools for every layer's decode state, the per-sequence slots and block tables."""

    def __init__(self, model, num_blocks: int, *, max_seqs: int, slack: int = 1, rings: bool = False,
                 sites: PagedSites = PagedSites(), device=None):
        """`model`: a loaded model (or anything with its cfg, state, facts, layers and stages);
        `num_blocks`: context capacity in blocks of `block_tokens` positions (each entry group gets
        cdiv(num_blocks, ratio) + max_seqs blocks); `slack`: positions one step may leave
        uncommitted (1 + the draft block when speculating); `rings`: drafter context rings;
        `device`: where the pools and every step's addresses live (default: torch's default)."""
        if max_seqs < 1 or num_blocks < 1 or slack < 1:
            raise ValueError(f"a paged cache needs max_seqs, num_blocks and slack >= 1 (got {max_seqs}, "
                             f"{num_blocks}, {slack})")
        self.cfg, self.sites, self.max_seqs, self.slack, self.num_blocks = model.cfg, sites, max_seqs, slack, num_blocks
        self.engram = getattr(model, "engram", None)      # V4.1's Engram hashing (lib/runtime/engram_ids.py)
        facts = model.facts
        self.block_tokens, self.logical_block_tokens = facts.block_tokens, facts.logical_block_tokens
        self.factor = self.block_tokens // self.logical_block_tokens
        self.shapes = pool_shapes(model.state, model.cfg, model.layers, model.stages if rings else (),
                                  compute_dtype=facts.compute_dtype, block_tokens=self.block_tokens,
                                  max_seqs=max_seqs, num_blocks=num_blocks, slack=slack,
                                  ring_multiple=facts.ring_rows_multiple)
        self.ratios = entry_ratios(self.shapes)
        self._alloc = {m: BlockAllocator(group_blocks(num_blocks, m, max_seqs)) for m in self.ratios}
        self._slots = BlockAllocator(max_seqs)
        self._seqs: dict[object, _Seq] = {}
        self.device = device
        tensors = {(s.owner, s.item): mapped_zeros(s.shape, s.dtype, device) for s in self.shapes}
        self._pools = [(s, tensors[(s.owner, s.item)]) for s in self.shapes]
        self._layer_infos = tuple(model.layers)
        self.layers = _backbone_pools(tensors, model.layers, sites)
        self.rings = tuple(LayerPools(tensors[(f"stage{layer.stage}", "window")], None, None)
                           for layer in (model.stages if rings else ()))
        # the ring sizes a step's rows are built for (lib/records/addressing.py with_step_rows): every
        # layer's window pool, every compressor ring, and the spans pooled into an entry of its ratio
        # (m positions, or 2m overlapping ones) that the ring can hold
        backbone = [p for p in self.shapes if p.owner.startswith("layer") and p.lifetime == "sequence"]
        comp = {(p.ratio, p.shape[1]) for p in backbone if p.item != "window"}
        self._step_geometry = {"window_rings": {p.shape[1] for p in backbone if p.item == "window"},
                               "rings": {r for _, r in comp},
                               "spans": {(m, n, r) for m, r in comp for n in (m, 2 * m) if n <= r}}

    @classmethod
    def for_lengths(cls, model, lengths: list[int], *, slack: int = 1, rings: bool = False,
                    sites: PagedSites = PagedSites()) -> PagedCache:
        """A cache just big enough for sequences of these lengths (tests, one-off runs)."""
        blocks = sum(-(-n // model.facts.block_tokens) for n in lengths)
        return cls(model, max(1, blocks), max_seqs=len(lengths), slack=slack, rings=rings, sites=sites)

    # ---- sequences and blocks ----------------------------------------------------------------
    def add(self, seq_id) -> None:
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already in the cache")
        if self._slots.free == 0:
            raise CacheFull(f"cannot add sequence {seq_id!r}: the cache holds its maximum of {self.max_seqs}")
        self._seqs[seq_id] = _Seq(self._slots.take(1)[0], {m: [] for m in self.ratios})

    def _seq(self, seq_id) -> _Seq:
        if seq_id not in self._seqs:
            raise KeyError(f"sequence {seq_id!r} is not in the cache (add it first)")
        return self._seqs[seq_id]

    def length(self, seq_id) -> int:
        return self._seq(seq_id).length

    def _needed(self, seq: _Seq | None, length: int) -> dict[int, int]:
        """New physical blocks per entry group so that entries of positions < length are addressable."""
        out = {}
        for m in self.ratios:
            held = len(seq.tables[m]) // self.factor if seq is not None else 0
            out[m] = max(0, -(-(length // m) // self.block_tokens) - held)
        return out

    def can_fit(self, seq_ids_and_lengths) -> bool:
        total = dict.fromkeys(self.ratios, 0)
        new = 0
        for seq_id, length in seq_ids_and_lengths:
            new += seq_id not in self._seqs
            for m, n in self._needed(self._seqs.get(seq_id), length).items():
                total[m] += n
        return new <= self._slots.free and all(total[m] <= self._alloc[m].free for m in total)

    def ensure(self, seq_id, length: int) -> None:
        """Allocate so entries of positions < length are addressable in every group, all or nothing."""
        seq = self._seq(seq_id)
        need = self._needed(seq, length)
        short = [f"{n} c{m} blocks ({self._alloc[m].free} of {self._alloc[m].num_blocks} free)"
                 for m, n in need.items() if n > self._alloc[m].free]
        if short:
            raise CacheFull(f"sequence {seq_id!r} needs {', '.join(short)} to hold {length} positions; "
                            f"nothing was allocated")
        for m, n in need.items():
            for block in self._alloc[m].take(n):
                seq.tables[m] += list(range(block * self.factor, (block + 1) * self.factor))

    def fork(self, src, dst) -> None:
        """Sequence `dst` (added, nothing written) continues from `src`'s committed positions: every ring row of
        src's slot and every complete entry is copied into dst's own (no block is shared, so each writes only its
        own from there on). The copies are tensor ops, so gradients reach src's rows through them (training's
        shared prompt prefixes: lib/training/target.py)."""
        s, d = self._seq(src), self._seq(dst)
        if d.written:
            raise ValueError(f"cannot fork {src!r} into {dst!r}: {dst!r} already has {d.written} positions written")
        self.ensure(dst, s.length)
        for spec, pool in self._pools:
            if spec.lifetime == "sequence":
                spare = pool.shape[0] - (self.max_seqs + 1)     # the unused slot 0 some rings keep (spec/state.yaml)
                pool[d.slot + spare] = pool[s.slot + spare]
                continue
            ids = torch.arange(s.length // spec.ratio, dtype=torch.int64)
            rows = [self.sites.physical_slots(torch.tensor([seq.tables[spec.ratio]], dtype=torch.int32),
                                              torch.zeros_like(ids), ids, self.block_tokens,
                                              self.logical_block_tokens).to(pool.device) for seq in (s, d)]
            pool.index_copy_(0, rows[1], pool.index_select(0, rows[0]))
        d.length = d.written = s.length
        d.engram = s.engram

    def set_length(self, seq_id, length: int) -> None:
        """Commit (or rewind to) `length` positions. Rings hold `slack` rows beyond what the
        committed length reads, so only the last `slack` written positions can be taken back."""
        seq = self._seq(seq_id)
        if not 0 <= length <= seq.written:
            raise ValueError(f"sequence {seq_id!r}: cannot commit length {length}: positions [0, {seq.written}) "
                             f"are written")
        if seq.written - length > self.slack:
            raise ValueError(f"sequence {seq_id!r}: cannot rewind to {length}: {seq.written} positions are written "
                             f"and the rings keep only {self.slack} uncommitted ones (slack)")
        seq.length = length

    def free(self, seq_id) -> None:
        """Return every block and the slot of the sequence and forget it."""
        seq = self._seq(seq_id)
        for m, table in seq.tables.items():
            self._alloc[m].give_back(sorted({t // self.factor for t in table}))
        self._slots.give_back([seq.slot])
        del self._seqs[seq_id]

    def usage(self) -> dict[str, tuple[int, int]]:
        """Pool -> (used, total): "slots" (sequences) and "c{m}" (entry blocks of ratio m)."""
        out = {"slots": (self._slots.used, self.max_seqs)}
        out.update({f"c{m}": (a.used, a.num_blocks) for m, a in self._alloc.items()})
        return out

    # ---- a step's addresses ------------------------------------------------------------------
    def address(self, batch: Batch, seq_ids: list, shape: StepShape | None = None) -> Batch:
        """`batch` with the Addressing of its sequences (sequence s continues at its committed
        length, its positions already ensured); marks the positions written.

        With a `shape` (a captured step's bucket) every tensor gets that bucket's static shape: the
        batch is padded with sequences of `shape.tokens` tokens at position 0 in the trash slot,
        block tables and read widths are those of `shape.max_len` positions, and the entry writes are
        padded to one per token row, the padding written to each entry pool's trash block."""
        seqs = [self._seq(s) for s in seq_ids]
        for seq_id, seq, start in zip(seq_ids, seqs, batch.starts):
            if seq.length != start:
                raise ValueError(f"sequence {seq_id!r}: the cache holds {seq.length} committed positions but "
                                 f"the batch continues at position {start}")
        ends = [s + n for s, n in zip(batch.starts, batch.seq_lens)]
        if any(self._needed(seq, end)[m] for seq, end in zip(seqs, ends) for m in self.ratios):
            raise ValueError("positions of this batch are not allocated; ensure() them first")
        if shape is not None:
            _check_fits(batch, ends, shape)
        engram, tails = self._engram_ids(batch, seqs, shape)     # the tails are kept once the step is addressed
        if shape is not None:
            batch = _padded(batch, shape)
        batch = batch._replace(engram_ids=engram)
        lens, starts = batch.seq_lens, batch.starts
        pad = len(lens) - len(seqs)
        all_ends = [s + n for s, n in zip(starts, lens)]
        lo = [sum(lens[:i]) for i in range(len(lens))]      # host ints: metadata is built on the host
        tables, writes = [], {}
        for m in self.ratios:
            held = [seq.tables[m] for seq in seqs] + [[]] * pad
            width = max(1, *map(len, held)) if shape is None else -(-(shape.max_len // m) // self.block_tokens) * self.factor
            table = torch.tensor([t + [-1] * (width - len(t)) for t in held], dtype=torch.int32).view(len(held), width)
            tables.append(GroupTable(m, table))
            writes[m] = self._entry_writes(m, table, starts[:len(seqs)], ends, lo,
                                           None if shape is None else sum(lens))
        for seq, end, tail in zip(seqs, ends, tails):
            seq.written = end
            if tail is not None:
                seq.engram = tail
        max_entries = {m: (max(all_ends) if shape is None else shape.max_len) // m for m in self.ratios}
        state = Addressing(_rows_of(lens), torch.tensor([seq.slot for seq in seqs] + [self.max_seqs] * pad),
                           torch.tensor(starts, dtype=torch.int64), torch.tensor(all_ends, dtype=torch.int64),
                           torch.tensor(lo, dtype=torch.int64), tuple(tables), writes, max_entries, self.max_seqs,
                           self.block_tokens, self.logical_block_tokens, self.sites,
                           max_len=max(all_ends) if shape is None else shape.max_len, step_tokens=max(lens))
        state = with_step_rows(state, batch.positions.cpu(), window=self.cfg.sliding_window, **self._step_geometry)
        # the Engram ids stay on the host with the tables they index (lib/weights/engram_table.py)
        return batch._replace(state=state if self.device is None else state.to(self.device))

    def _engram_ids(self, batch: Batch, seqs: list[_Seq], shape: StepShape | None):
        """(the batch's Engram hash ids, or None without Engram layers; each sequence's tail of compressed ids to
        keep for its next step), each sequence hashed after its committed positions."""
        if self.engram is None:
            return None, [None] * len(seqs)
        keep = self.engram.params.window + self.slack
        with allow("the step's token ids are host data (make_batch builds them from lists): hashed on the host"):
            tokens = batch.tokens.tolist()
        lo, parts, tails = 0, [], []
        for seq, start, n in zip(seqs, batch.starts, batch.seq_lens):
            ids, tail = step_ids(self.engram, seq.engram, start, tokens[lo:lo + n], keep)
            parts.append(ids)
            tails.append(tail)
            lo += n
        pad = 0 if shape is None else shape.seqs * shape.tokens - lo
        return as_tensor(parts, pad, self.engram.params.shape_tail), tails

    def _entry_writes(self, m: int, table: torch.Tensor, starts, ends, lo: list[int],
                      pad_to: int | None = None) -> EntryWrites:
        """The entries tokens [start, end) complete: entry e by the token at position (e + 1) m - 1;
        its pool row from the slot-side arithmetic (sites: where B13 goes wrong). With `pad_to`,
        padded to that many writes of entry -1 of sequence 0 into the trash block's first row: its
        positions are all negative, so whatever it pools is read from valid ring rows (and masked)."""
        done = [(k, e) for k, (s, end) in enumerate(zip(starts, ends)) for e in range(s // m, end // m)]
        seq = torch.tensor([k for k, _ in done], dtype=torch.int64)
        ids = torch.tensor([e for _, e in done], dtype=torch.int64)
        rows = torch.tensor([lo[k] + (e + 1) * m - 1 - starts[k] for k, e in done], dtype=torch.int64)
        at = torch.cat([self.sites.entry_ids(m, s, end) for s, end in zip(starts, ends)] or [ids])
        slots = self.sites.physical_slots(table, seq, at, self.block_tokens, self.logical_block_tokens)
        if pad_to is None:
            return EntryWrites(rows, seq, ids, slots)
        extra = pad_to - len(done)
        fill = lambda t, v: torch.cat((t, torch.full((extra,), v, dtype=torch.int64)))
        return EntryWrites(fill(rows, 0), fill(seq, 0), fill(ids, -1),
                           fill(slots, self._alloc[m].num_blocks * self.block_tokens))

    # ---- drafter rings -----------------------------------------------------------------------
    def ring_address(self, seq_ids: list, batch: Batch) -> Batch:
        """A draft batch's addresses: slots and committed lengths only (the drafter reads its
        rings; nothing of the target's state)."""
        seqs = [self._seq(s) for s in seq_ids]
        state = ring_addressing(batch.seq_lens, [seq.slot for seq in seqs], [seq.length for seq in seqs],
                                self.max_seqs, self.block_tokens, self.logical_block_tokens, self.sites)
        return batch._replace(state=state if self.device is None else state.to(self.device))

    def window_address(self, seq_ids: list, batch: Batch) -> Batch:
        """The addresses of a batch through a sliding-window drafter layer (MTP) over its own window ring:
        sequence s continues at `batch.starts[s]`, the drafter's position, not the target's committed length
        (its ring rows of positions from there on are this batch's own; older ones are read from the ring)."""
        seqs = [self._seq(s) for s in seq_ids]
        ends = [start + n for start, n in zip(batch.starts, batch.seq_lens)]
        state = ring_addressing(batch.seq_lens, [seq.slot for seq in seqs], list(batch.starts), self.max_seqs,
                                self.block_tokens, self.logical_block_tokens, self.sites)
        state = state._replace(max_len=max(ends), step_tokens=max(batch.seq_lens))
        state = with_step_rows(state, batch.positions.cpu(), window=self.cfg.sliding_window,
                               window_rings={p.window.shape[1] for p in self.rings}, rings=set(), spans=set())
        return batch._replace(state=state if self.device is None else state.to(self.device))

    def write_ring(self, seq_id, start: int, rows: list[torch.Tensor]) -> None:
        """rows[s] [n, D]: drafter stage s's ring rows for committed positions [start, start + n)."""
        seq = self._seq(seq_id)
        for pools, values in zip(self.rings, rows, strict=True):
            ring = pools.window
            r = ring.shape[1]
            n = min(values.shape[0], r)
            q = torch.arange(start + values.shape[0] - n, start + values.shape[0])
            with torch.no_grad():
                ring.view(-1, ring.shape[-1]).index_copy_(0, (seq.slot * r + q % r).to(ring.device),
                                                          values[-n:].to(ring.device, ring.dtype))

    # ---- inspection ----------------------------------------------------------------------------
    def live_rows(self, seq_id) -> dict[str, torch.Tensor]:
        """Every row the sequence's committed length L can still read, by "<owner>.<item>" of the layer that reads
        it: window and drafter rings of positions [L - W, L), compressor rings of the unfinished window (and,
        overlapping, the one before), entries [0, L // m) (a V4.1 layer after a KV source: the source's). What tests compare to show that
        rejected positions left no trace."""
        seq = self._seq(seq_id)
        length, window, out = seq.length, self.cfg.sliding_window, {}
        for owner, pools, ratio, overlap in self._owners():
            if pools.window is not None:
                out[f"{owner}.window"] = _ring_read(pools.window, seq.slot, max(0, length - window), length)
            for name, comp in (("comp", pools.comp), ("index", pools.index)):
                if comp is None:            # a V4.1 layer after a KV source lists the source's rows it reads
                    continue
                lo = max(0, length // ratio * ratio - (ratio if overlap else 0))
                if comp.state is not None:
                    out[f"{owner}.{name}.kv"] = _ring_read(comp.kv, seq.slot, lo, length)
                    out[f"{owner}.{name}.gate"] = _ring_read(comp.gate, seq.slot, lo, length)
                ids = torch.arange(length // ratio, dtype=torch.int64)
                table = torch.tensor([seq.tables[ratio]], dtype=torch.int32)
                rows = self.sites.physical_slots(table, torch.zeros_like(ids), ids, self.block_tokens,
                                                 self.logical_block_tokens)
                out[f"{owner}.{name}.entries"] = comp.entries[rows]
        return out

    def _owners(self):
        attention = {f"layer{layer.index}": layer.attention for layer in self._layer_infos}
        for (owner, ratio), pools in zip(((f"layer{l.index}", l.ratio) for l in self._layer_infos), self.layers):
            yield owner, pools, ratio, attention[owner] == "csa"
        for stage, pools in enumerate(self.rings):
            yield f"stage{stage}", pools, 0, False

    # ---- sizes ---------------------------------------------------------------------------------
    def bytes_per_token(self) -> float:
        """Bytes one context position adds: its share of every entry pool's rows."""
        return sum(s.row_bytes / s.ratio for s in self.shapes if s.lifetime == "entry")

    def bytes_per_sequence(self) -> int:
        """Fixed bytes one sequence's slot takes in every ring pool."""
        return sum(s.bytes // s.shape[0] for s in self.shapes if s.lifetime == "sequence")

    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.shapes)


def _check_fits(batch: Batch, ends: list[int], shape: StepShape) -> None:
    """A bucketed step takes at most `shape.seqs` sequences of exactly `shape.tokens` new tokens each,
    none reading past `shape.max_len` positions."""
    if len(batch.seq_lens) > shape.seqs:
        raise ValueError(f"{len(batch.seq_lens)} sequences do not fit a step bucket of {shape.seqs}")
    if any(n != shape.tokens for n in batch.seq_lens):
        raise ValueError(f"a step bucket of {shape.tokens} new tokens per sequence got {list(batch.seq_lens)}")
    if ends and max(ends) > shape.max_len:
        raise ValueError(f"a sequence reaches position {max(ends)}, past the bucket's {shape.max_len}")


def _padded(batch: Batch, shape: StepShape) -> Batch:
    """`batch` with padding sequences of `shape.tokens` tokens (token 0, positions from 0) up to
    `shape.seqs` sequences; each padding sequence's last row is a logit row when the batch has any."""
    pad = shape.seqs - len(batch.seq_lens)
    lens, starts = batch.seq_lens + (shape.tokens,) * pad, batch.starts + (0,) * pad
    real = batch.tokens.shape[0]
    tokens = torch.cat((batch.tokens, batch.tokens.new_zeros(pad * shape.tokens)))
    positions = torch.cat((batch.positions, positions_of(lens[len(batch.seq_lens):], starts[len(batch.seq_lens):])))
    rows = batch.logit_rows
    if rows is not None:
        rows = torch.cat((rows, real + shape.tokens * torch.arange(1, pad + 1, dtype=rows.dtype) - 1))
    return batch._replace(tokens=tokens, positions=positions, seq_lens=lens, starts=starts, logit_rows=rows)


def ring_addressing(seq_lens, slots: list[int], starts: list[int], max_seqs: int, block_tokens: int,
                    logical_block_tokens: int, sites: PagedSites = PagedSites()) -> Addressing:
    """The addresses of a draft batch: each sequence's ring slot and committed length, nothing of the target's
    state (PagedCache.ring_address; the drafter's training builds its rings itself)."""
    lo = [sum(seq_lens[:i]) for i in range(len(seq_lens))]
    return Addressing(_rows_of(seq_lens), torch.tensor(slots, dtype=torch.int64), torch.tensor(starts, dtype=torch.int64),
                      torch.tensor([s + n for s, n in zip(starts, seq_lens)], dtype=torch.int64),
                      torch.tensor(lo, dtype=torch.int64), (), {}, {}, max_seqs, block_tokens, logical_block_tokens, sites)


def _rows_of(seq_lens) -> torch.Tensor:
    """[T] int64 batch sequence of each token row."""
    return torch.tensor([k for k, n in enumerate(seq_lens) for _ in range(n)], dtype=torch.int64)


def _ring_read(pool: torch.Tensor, slot: int, lo: int, hi: int) -> torch.Tensor:
    """Rows of positions [lo, hi) of one slot of a ring pool [slots, R, C]."""
    return pool[slot].index_select(0, torch.arange(lo, hi) % pool.shape[1])


def _layer_pools(tensors: dict, owner: str, ratio: int) -> LayerPools:
    def compressor(prefix: str) -> CompressorPools | None:
        if (owner, f"{prefix}.entries") not in tensors:
            return None
        return CompressorPools(tensors.get((owner, f"{prefix}.state")), tensors[(owner, f"{prefix}.entries")], ratio)
    return LayerPools(tensors.get((owner, "window")), compressor("comp"), compressor("index"))


def _backbone_pools(tensors: dict, layers, sites: PagedSites) -> tuple[LayerPools, ...]:
    """Every backbone layer's pools; a compressed layer that makes no KV of its own (V4.1, after a KV source) reads
    the latest source's compressor and key pools (sites.reused_pools: lib/records/addressing.py)."""
    out, source = [], None
    for layer in layers:
        pools = _layer_pools(tensors, f"layer{layer.index}", layer.ratio)
        if layer.kv_source:
            source = pools
        elif layer.ratio and source is not None:
            pools = sites.reused_pools(source, pools)
        out.append(pools)
    return tuple(out)
