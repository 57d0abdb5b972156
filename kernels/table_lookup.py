"""The lookup of tables ahead: which branch of each request's table holds the outcome a sampler settled.

A drafter with tables ahead (EagleProposer.queue_after_verification with num_branches) drafts, while a
verification runs, a table of its outcomes: per request up to N branches (accepted drafts a, bonus token c)
with K drafts each, in rows [first, first + N) of the branch loop's outputs. Once the sampler has settled,
this finds each request's branch and, if every request hit, may publish the branches' drafts into the
verifier's buffer and then the step's number into its slot: the verifier's next verification reads them
before any serial drafting has run.

On CUDA one Triton program does it all (table_lookup_triton): fifteen torch ops and a copy cost the drafter's
host about 0.7 ms a round, enough to start the lookup after the sampler it waits for had ended (8B shape,
bench/results/session45/). look_up_ref is the same in torch: the CPU path and the test oracle.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

try:  # CPU-only installs may lack Triton; they run the reference.
    from specwire.kernels import table_lookup_triton
except ImportError:
    table_lookup_triton = None


class Table(NamedTuple):
    """The branch loop's outputs, one row per branch (request b's at first[b] + i), and what says a row is a
    branch the table holds: a slot of its own (not `trash`) and a score > 0 (an outcome that can happen)."""

    slots: torch.Tensor  # [rows] int64
    score: torch.Tensor  # [rows] float32
    accepted: torch.Tensor  # [rows] int64
    bonus: torch.Tensor  # [rows] int64
    tokens: torch.Tensor  # [rows, K] int64: the branch's drafts
    trash: int
    num_branches: int  # N


class Lookup(NamedTuple):
    """Where the lookup leaves its results (on the drafter's device)."""

    hit_index: torch.Tensor  # [>= B] int64: the branch i < N of request b's table that hit, -1 for a miss
    drafts: torch.Tensor  # [>= B, K] int64: that branch's drafts (a miss's row: any branch's)
    all_hit: torch.Tensor  # [] int32: 1 when every request hit


class Address:
    """A raw device address (a mapped host slot) passed to a kernel as an int64 pointer."""

    dtype = torch.int64

    def __init__(self, address: int):
        self._address = address

    def data_ptr(self) -> int:
        return self._address


class Publish(NamedTuple):
    """Where the drafts go when every request hit: the verifier's buffer (B x K ids from its start), then
    `value` into `slot` (an int64 cell: a tensor, or a mapped host address with data_ptr and dtype)."""

    buffer: torch.Tensor
    slot: object
    value: int


def look_up_ref(settled: torch.Tensor, rows: torch.Tensor, first: torch.Tensor, table: Table,
                draws: torch.Tensor | None, rate: float, out: Lookup, publish: Publish | None = None) -> None:
    """settled [M, W] int64: the sampler's packed output (count, -1 for a failed row, then the tokens);
    rows[b] request b's row of it; first[b] where its table's rows start (-1: none). draws [B] uniform
    (with a forced hit rate `rate`): a request that missed but whose table holds a branch for its number of
    accepted drafts takes the first of those when draws[b] < rate."""
    B, N, K = first.shape[0], table.num_branches, table.tokens.shape[1]
    mine = settled.index_select(0, rows)
    count = mine[:, 0]
    bonus = mine.gather(1, count.clamp(1, mine.shape[1] - 1)[:, None])
    cells = (first[:, None] + torch.arange(N, device=first.device)).clamp_min(0)  # [B, N]
    held = (first[:, None] >= 0) & (table.slots[cells] != table.trash) & (table.score[cells] > 0)
    same_count = held & (table.accepted[cells] == count[:, None] - 1)
    found = same_count & (table.bonus[cells] == bonus)
    hit = found.any(1)
    # the first match: a table's rows are in the order it scored them, so a forced hit takes the likeliest
    pick = torch.where(hit, found.int().argmax(1), same_count.int().argmax(1))
    if draws is not None:
        hit = hit | (same_count.any(1) & (draws[:B] < rate))
    out.hit_index[:B] = torch.where(hit, pick, -1)
    out.drafts[:B] = table.tokens[cells.gather(1, pick[:, None])[:, 0]]
    out.all_hit.copy_(hit.all())
    if publish is not None and bool(hit.all()):  # (a host read: the reference runs on CPUs)
        publish.buffer.view(-1)[:B * K] = out.drafts[:B].flatten()
        publish.slot.fill_(publish.value)


def look_up(settled: torch.Tensor, rows: torch.Tensor, first: torch.Tensor, table: Table,
            draws: torch.Tensor | None, rate: float, out: Lookup, publish: Publish | None = None) -> None:
    """look_up_ref's results, queued without a wait: on CUDA one Triton program (which also publishes, on
    the device's word: the host never learns before), else the reference."""
    # (not ops' SPECWIRE_TORCH_OPS switch: on a GPU the reference cannot write a mapped host address)
    if table_lookup_triton is not None and first.is_cuda:
        table_lookup_triton.look_up(settled, rows, first, table, draws, rate, out, publish)
    else:
        look_up_ref(settled, rows, first, table, draws, rate, out, publish)
