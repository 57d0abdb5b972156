"""Target features kept where an in-process drafter reads them: on its device, never on the host.

A drafter behind gRPC or the step socket gets each request's features as bytes in its DraftSteps, so the
verifier reads them back to the host and keeps them there (scheduler.FeatureRows). A co-located drafter
takes tensors: each forward's feature table (the columns the drafter asked for, in the dtype of its
handshake) is copied once to the drafter's device, into one buffer indexed by (engine slot, position), and a
step hands over views of it. (Traced at the 8B shape with batch 16, the host path spent about 2.2 ms of a
10 ms round on those copies: bench/results/session15_h200x2/.)

A verification writes the rows of every token it was fed, before its sampler has said how many settle: the
rows of rejected drafts are rewritten by the next verification (it starts at the first of them) before any
step hands them over, as a step only sends rows of settled tokens. Rows of settled tokens are never
rewritten while their request lives, and a slot is written only by the request in it, so a view handed over
stays valid for its request. The buffer is sized like the KV cache: slots x max_context x feature width
(15-20% of the target's KV bytes for the shipped shapes); on a CPU it is allocated untouched, so positions
never written cost nothing.

With the drafter on another GPU, the writes go on a side stream of the drafter's GPU. A copy between two GPUs
makes the destination's stream wait for the source's: on the drafter's own stream, everything the drafter
queued after a write (its tables for this very verification) would wait for the verification's forward.
Whoever hands the drafter rows calls `ready` first, which makes the drafter's stream wait for the writes.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from specwire.staging import upload


def _column_key(columns: slice | np.ndarray) -> slice | tuple[int, ...]:
    """Columns in a form that compares by value (an array's == compares element-wise)."""
    return columns if isinstance(columns, slice) else tuple(columns.tolist())


def feature_table(hidden: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
    """Per token: the final normed hidden state, then the aux taps (the drafter picks its columns)."""
    return hidden if aux is None else torch.cat([hidden, aux], dim=-1)


def _part(hidden: torch.Tensor, aux: torch.Tensor | None, span: tuple[int, int], n: int
          ) -> tuple[torch.Tensor, int]:
    """The first n rows of the part of feature_table(hidden, aux) that holds columns [span[0], span[1]), and
    the table's index of that part's first column, without building the table where the columns lie in one
    of its parts: an EAGLE-3 head takes only the aux taps, and the concatenation took 13% of the engine
    thread's time a verification (py-spy, bench/results/session12_h200x2/)."""
    H = hidden.shape[-1]
    if span[1] <= H:
        return hidden[:n], 0
    if aux is not None and span[0] >= H:
        return aux[:n], H
    return feature_table(hidden[:n], None if aux is None else aux[:n]), 0


class FeatureStore:
    def __init__(self, slots: int, max_context: int, columns: slice | np.ndarray, width: int,
                 dtype: torch.dtype, device: torch.device, source: torch.device | None = None):
        """columns: the feature table's columns the drafter asked for (`width` of them); source: the device
        the tables come from (the target's), when it is another GPU than `device`."""
        self.rows = torch.empty(slots, max_context, width, dtype=dtype, device=device)
        if isinstance(columns, slice):
            assert columns.step in (None, 1) and columns.stop is not None, "columns: a contiguous slice"
            columns = slice(columns.start or 0, columns.stop)
            self._columns, self._span = columns, (columns.start, columns.stop)
        else:
            self._columns = torch.as_tensor(columns)
            self._span = (int(columns.min()), int(columns.max()) + 1)
        self._picked = _column_key(columns)
        # Index columns as the part they are picked from counts them, on its device: made once, since an
        # upload from pageable memory waits for the stream (and the launch queued on it) each time.
        self._indices: dict[tuple[int, torch.device], torch.Tensor] = {}
        device = torch.device(device)
        crossing = device.type == "cuda" and source is not None and torch.device(source) != device
        self._stream = torch.cuda.Stream(device) if crossing else None
        self._written = torch.cuda.Event() if crossing else None

    def write(self, hidden: torch.Tensor, aux: torch.Tensor | None, slots: list[int], positions: list[int]
              ) -> None:
        """rows[slots[i], positions[i]] = the picked columns of feature_table(hidden, aux) row i, for every i.
        Queued on both devices' streams without a wait; the inputs may be overwritten by whatever is queued
        after."""
        part, first = _part(hidden, aux, self._span, len(slots))
        if isinstance(self._columns, slice):
            picked = part[:, self._columns.start - first:self._columns.stop - first]
        else:
            picked = part.index_select(1, self._column_index(first, part.device))
        # One copy of flat indices and one index_copy_: an index_put_ over (slot, position) pairs cost about
        # twice the host time (py-spy, SmolLM2 co-located at batch 16, bench/results/session36/).
        cells = np.asarray(slots, dtype=np.int64) * self.rows.shape[1] + np.asarray(positions, dtype=np.int64)
        with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
            where = upload(torch.from_numpy(cells), self.rows.device)
            self.flat.index_copy_(0, where, picked.to(self.rows.device, self.rows.dtype))
            if self._written is not None:
                self._written.record(self._stream)

    def _column_index(self, first: int, device: torch.device) -> torch.Tensor:
        if (index := self._indices.get((first, device))) is None:
            index = self._indices[first, device] = (self._columns - first).to(device)
        return index

    def holds(self, columns: slice | np.ndarray, width: int, dtype: torch.dtype, device: torch.device
              ) -> bool:
        """Whether this store keeps what a drafter asking for these columns, width, dtype and device takes."""
        return (_column_key(columns) == self._picked and self.rows.shape[-1] == width
                and self.rows.dtype == dtype and self.rows.device == torch.device(device))

    def ready(self) -> None:
        """Makes the current stream of the store's device (the drafter's) wait for every write queued so far:
        called before rows are handed to the drafter. Nothing to do when both sides share a device."""
        if self._written is not None:
            torch.cuda.current_stream(self.rows.device).wait_event(self._written)

    @property
    def flat(self) -> torch.Tensor:
        """The buffer as rows [slots * max_context, width], indexed by `cells`."""
        return self.rows.view(-1, self.rows.shape[-1])

    def cells(self, slot: int, start: int, count: int) -> list[int]:
        """Indices into `flat` of rows[slot, start:start + count], the last row repeated past the context."""
        context = self.rows.shape[1]
        return [slot * context + min(position, context - 1) for position in range(start, start + count)]

    def row(self, slot: int, position: int) -> int:
        """The index into `flat` of rows[slot, position]."""
        return slot * self.rows.shape[1] + position

    def view(self, slot: int, start: int, end: int) -> torch.Tensor:
        """A request's rows [start, end): shared with the buffer, valid while that request holds the slot."""
        return self.rows[slot, start:end]
