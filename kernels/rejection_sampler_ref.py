"""Speculative rejection sampling in plain PyTorch: the CPU path and the oracle for the Triton kernel.

Layout: request b has num_drafts[b] = k_b drafts and k_b + 1 target rows (row j scores position
positions[b] + j). Row j < k_b checks draft j; row k_b is the bonus row. A request emits its accepted drafts
plus one token: the recovered token at the first rejection, or the bonus token when all drafts pass.

Rules, per row (p = target distribution after temperature, top-k and top-p; q = draft distribution):
- greedy (temperature 0): accept iff draft == argmax(logits) (lowest index on ties); emit the argmax.
- random, dense or sparse q: accept iff u * q(x) < p(x), i.e. with probability min(1, p(x) / q(x)); on
  rejection sample from norm(max(0, p - q)). q(x) = 0 with p(x) > 0 always accepts; p(x) = 0 always rejects.
- random, one-hot q (draft_probs None): the row's token y is the race winner over p, the very token
  target-only sampling draws at that position; accept iff x == y, and emit y either way. This accepts with
  probability p(x), as min(1, p(x) / 1) does, and is lossless for any x; seeded output does not depend on
  the drafts at all.
- bonus rows, and draft rows whose id is invalid (-1 padding or >= V), sample from p; an invalid draft
  counts as rejected, so nothing after it is accepted.
- synthetic mode replaces the acceptance test by u < rate[j] (for benchmarks); emitted tokens follow the
  same rules (with one-hot q a rejected row emits y, which may equal x).

Sampling is an exponential race, argmax_i w_i / E_i with E_i = -log(u_i), which needs no normalisation.
For p it runs in log space, key_i = z_i - log(E_i) with z = logits / temperature; for the residual
of a sparse q the support S gets keys m + log(s) + log(max(0, p_i - q_i)) - log(E_i) on the
same scale (m, s: softmax max and sum); for a dense q the keys are max(0, p_i - q_i) / E_i. If rounding
leaves the residual with no mass (p <= q everywhere), the token is sampled from p (same draws).

Randomness is Philox4x32-10 keyed by the request's seed, counters (c0, position, stream, SALT): the
acceptance draw is lane 0 of c0 = 0 in STREAM_ACCEPT; vocab entry i draws lane i % 4 of c0 = i // 4 in
STREAM_TOKEN. So a seeded request repeats whatever else is in the batch. The SALT word keeps these streams
apart from any tl.rand(seed, offset) a drafter might use (its counters have c3 = 0).

Top-k / top-p keep z_i >= threshold (ties at the threshold are kept). Logits may hold -inf (masked
tokens); NaN, +inf, or a row with no finite logit raise SamplerInputError, as do NaN, inf or negative draft
probabilities.
"""

from dataclasses import dataclass

import torch
from specwire.kernels.philox import philox_uniforms

from specwire.staging import read_back

STREAM_TOKEN, STREAM_ACCEPT = 0, 1
SALT = 0x53505752  # "SPWR"
NEG_INF = float("-inf")


class SamplerInputError(ValueError):
    """Bad input to the rejection sampler (shape, dtype, value, or NaN/inf)."""


@dataclass(frozen=True)
class DraftProbs:
    """Float32 draft probabilities per draft token: dense [D, V], or top-K sparse [D, K] indices + values.

    Sparse rows must hold distinct indices; -1 marks an unused slot. The draft must have been sampled from
    exactly this (truncated, renormalised) q.
    """

    probs: torch.Tensor | None = None
    indices: torch.Tensor | None = None
    values: torch.Tensor | None = None

    @classmethod
    def dense(cls, probs: torch.Tensor) -> "DraftProbs":
        return cls(probs=probs)

    @classmethod
    def sparse(cls, indices: torch.Tensor, values: torch.Tensor) -> "DraftProbs":
        return cls(indices=indices, values=values)

    @property
    def is_dense(self) -> bool:
        return self.probs is not None


@dataclass(frozen=True)
class SampleOutput:
    """Per request, its count of emitted tokens (accepted + 1) and then the tokens, padded with -1, in one
    int64 tensor [B, max_k + 2]: the host reads a batch's result with one copy. A count of -1 marks a
    request whose rows held NaN/inf input, left for token_lists() or check() to raise (the kernel's path)."""

    packed: torch.Tensor

    @property
    def tokens(self) -> torch.Tensor:
        """[B, max_k + 1] int64: accepted drafts + one token, padded with -1."""
        return self.packed[:, 1:]

    @property
    def num_tokens(self) -> torch.Tensor:
        """[B] int32 = accepted + 1."""
        return self.packed[:, 0].int()

    def check(self) -> None:
        """Raise SamplerInputError if a request's rows held bad input (waits for the device)."""
        bad = torch.nonzero(self.packed[:, 0] < 0).squeeze(1)
        if bad.numel() > 0:
            raise _bad_requests(bad.tolist())

    def token_lists(self, host: torch.Tensor | None = None) -> list[list[int]]:
        """Each request's emitted tokens, read with one device-to-host copy (or from `host`, a copy of
        `packed` already read back); raises as check() does."""
        rows = (read_back(self.packed) if host is None else host).tolist()
        if bad := [b for b, row in enumerate(rows) if row[0] < 0]:
            raise _bad_requests(bad)
        return [row[1: 1 + row[0]] for row in rows]


def _bad_requests(requests: list[int]) -> SamplerInputError:
    return SamplerInputError(f"target rows of requests {requests[:8]} hold NaN/+inf logits, no finite logit, "
                             "or NaN/inf/negative draft probabilities")


@dataclass(frozen=True)
class SamplerBatch:
    """Validated inputs on the logits' device (built by rejection_sampler.batch_with)."""

    logits: torch.Tensor  # [R, V] float, R = sum(k_b + 1)
    draft_ids: torch.Tensor  # [D] int64
    cu_drafts: torch.Tensor  # [B + 1] int64: request b's drafts are draft_ids[cu_drafts[b]:cu_drafts[b + 1]]
    row_request: torch.Tensor  # [R] int64, the request of each target row
    max_drafts: int
    draft_probs: DraftProbs | None
    temperature: torch.Tensor  # [B] float32, 0 = greedy
    seed: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    synthetic: torch.Tensor | None  # [>= max_drafts] float32 acceptance rate per draft position
    thresholds: torch.Tensor | None  # [R] float32 in z space, -inf = keep all; None = no row filters


@dataclass(frozen=True)
class RowLayout:
    request: torch.Tensor  # [R] request of each target row
    index: torch.Tensor  # [R] j, the row's index inside its request
    draft: torch.Tensor  # [R] index into the draft arrays (clamped; meaningful where has_draft)
    has_draft: torch.Tensor  # [R] j < k_b


def row_layout(batch: SamplerBatch) -> RowLayout:
    request, cu = batch.row_request, batch.cu_drafts
    first_draft = cu[request]
    index = torch.arange(request.numel(), device=request.device) - first_draft - request  # row = draft + b
    has_draft = index < cu[request + 1] - first_draft
    draft = (first_draft + index).clamp(0, max(batch.draft_ids.numel() - 1, 0))
    return RowLayout(request, index, draft, has_draft)


def token_uniforms(seed: torch.Tensor, position: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[n, V] uniforms of STREAM_TOKEN for rows with the given seed and position."""
    counters = torch.arange((vocab_size + 3) // 4, device=seed.device)
    u = philox_uniforms(seed[:, None], counters[None, :], position[:, None], torch.tensor(STREAM_TOKEN),
                        torch.tensor(SALT))
    return u.reshape(seed.numel(), -1)[:, :vocab_size]


def accept_uniforms(seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    u = philox_uniforms(seed, torch.tensor(0), position, torch.tensor(STREAM_ACCEPT), torch.tensor(SALT))
    return u[..., 0]


def logit_thresholds(logits: torch.Tensor, rows: torch.Tensor, inv_temperature: torch.Tensor,
                     top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per-row z threshold for top-k then top-p (HF order); -inf (keep all) outside the given rows.

    rows [F] are the rows that filter, with their 1 / temperature, top_k in [1, V] and top_p. Top-k keeps the
    k largest z; top-p then keeps the smallest prefix of the sorted, top-k-renormalised distribution whose
    mass reaches top_p. Only these rows are sorted; nothing here waits for the device.
    """
    V = logits.shape[1]
    z = logits.index_select(0, rows).float() * inv_temperature[:, None]
    z_sorted = z.sort(dim=1, descending=True).values
    in_top_k = torch.arange(V, device=z.device)[None, :] < top_k[:, None]
    probs = torch.softmax(z_sorted.masked_fill(~in_top_k, NEG_INF), dim=1)
    mass_before = probs.cumsum(1) - probs
    kept = ((mass_before < top_p[:, None]) & in_top_k).sum(1).clamp(min=1)
    thresholds = torch.full((logits.shape[0],), NEG_INF, dtype=torch.float32, device=logits.device)
    return thresholds.scatter_(0, rows, z_sorted.gather(1, (kept - 1)[:, None]).squeeze(1))


def check_logits(logits: torch.Tensor) -> None:
    bad = torch.isnan(logits) | (logits == float("inf"))
    if bool(bad.any()):
        raise SamplerInputError(f"target_logits rows {_first_rows(bad.any(1))} contain NaN or +inf")
    empty = (logits == NEG_INF).all(1)
    if bool(empty.any()):
        raise SamplerInputError(f"target_logits rows {_first_rows(empty)} have no finite logit")


def check_probs(name: str, probs: torch.Tensor) -> None:
    bad = ~torch.isfinite(probs) | (probs < 0)
    if bool(bad.any()):
        raise SamplerInputError(f"{name} rows {_first_rows(bad.reshape(bad.shape[0], -1).any(1))} "
                                "contain NaN, inf or negative values")


def _first_rows(mask: torch.Tensor, limit: int = 8) -> list[int]:
    return torch.nonzero(mask).squeeze(1)[:limit].tolist()


def _random_rows(batch: SamplerBatch, logits: torch.Tensor, rows: torch.Tensor, layout: RowLayout,
                 x: torch.Tensor, valid: torch.Tensor, u_accept: torch.Tensor, rate: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, accept) for the given rows of random requests."""
    req, V = layout.request[rows], logits.shape[1]
    x, valid, d = x[rows], valid[rows], layout.draft[rows]
    xs = torch.where(valid, x, 0)
    z = logits[rows] * (1.0 / batch.temperature[req])[:, None]
    if batch.thresholds is not None:
        z = torch.where(z >= batch.thresholds[rows][:, None], z, NEG_INF)
    E = -torch.log(token_uniforms(batch.seed[req], batch.positions[req] + layout.index[rows], V))
    race = z - torch.log(E)  # over p: rows without a (valid) draft, one-hot q, the empty-residual fallback
    q = batch.draft_probs
    if q is None:  # one-hot q: the race winner is the row's token; the draft passes iff it won
        winner = race.argmax(1)
        accept = valid & ((u_accept[rows] < rate[rows]) if rate is not None else (x == winner))
        return torch.where(accept, x, winner), accept
    m = z.max(1).values
    s = torch.exp(z - m[:, None]).sum(1)
    inv_s = 1.0 / s
    p_x = torch.exp(z.gather(1, xs[:, None]).squeeze(1) - m) * inv_s
    key, empty_key = race, NEG_INF
    if q.is_dense:
        q_rows = q.probs[d]
        check_probs("draft_probs", q_rows[valid])
        q_x = q_rows.gather(1, xs[:, None]).squeeze(1)
        residual = torch.clamp(torch.exp(z - m[:, None]) * inv_s[:, None] - q_rows, min=0) / E
        key = torch.where(valid[:, None], residual, key)
        empty_key = 0.0
    else:
        idx, val = q.indices[d].long(), q.values[d]
        in_vocab = (idx >= 0) & (idx < V) & valid[:, None]
        check_probs("draft_probs values", torch.where(in_vocab, val, 0.0))
        idx_c = torch.where(in_vocab, idx, V)  # column V is a scratch column for unused slots
        q_x = torch.where(in_vocab & (idx == x[:, None]), val, 0.0).sum(1)
        z_s = torch.nn.functional.pad(z, (0, 1), value=NEG_INF).gather(1, idx_c)
        p_s = torch.exp(z_s - m[:, None]) * inv_s[:, None]
        E_s = torch.nn.functional.pad(E, (0, 1), value=1.0).gather(1, idx_c)
        key_s = (m + torch.log(s))[:, None] + torch.log(torch.clamp(p_s - val, min=0)) - torch.log(E_s)
        key = torch.nn.functional.pad(key, (0, 1)).scatter(1, idx_c, torch.where(in_vocab, key_s, NEG_INF))
        key = key[:, :V]
    accept = valid & ((u_accept[rows] < rate[rows]) if rate is not None else (u_accept[rows] * q_x < p_x))
    empty = valid & (key.max(1).values == empty_key)
    recovered = torch.where(empty, race.argmax(1), key.argmax(1))
    return torch.where(accept, x, recovered), accept


def sample_ref(batch: SamplerBatch) -> SampleOutput:
    logits = batch.logits.float()
    R, V = logits.shape
    B = batch.cu_drafts.numel() - 1
    check_logits(logits)
    layout = row_layout(batch)
    if batch.draft_ids.numel() > 0:
        x = torch.where(layout.has_draft, batch.draft_ids[layout.draft], -1)
    else:
        x = torch.full((R,), -1, dtype=torch.long, device=logits.device)
    valid = layout.has_draft & (x >= 0) & (x < V)
    seed = batch.seed[layout.request]
    u_accept = accept_uniforms(seed, batch.positions[layout.request] + layout.index)
    rate = None
    if batch.synthetic is not None:
        rate = batch.synthetic[layout.index.clamp(max=batch.synthetic.numel() - 1)]

    # Greedy rows first; random rows overwrite their entries.
    argmax = logits.argmax(1)
    accept = valid & ((u_accept < rate) if rate is not None else (x == argmax))
    token = torch.where(accept, x, argmax)
    rows = torch.nonzero(batch.temperature[layout.request] > 0).squeeze(1)
    if rows.numel() > 0:
        token[rows], accept[rows] = _random_rows(batch, logits, rows, layout, x, valid, u_accept, rate)

    # First non-accepted row per request (the bonus row never accepts) ends the request's output.
    first = torch.full((B,), R, dtype=torch.long, device=logits.device)
    first = first.scatter_reduce(0, layout.request, torch.where(accept, R, layout.index), reduce="amin")
    emitted = layout.index <= first[layout.request]
    packed = torch.full((B, batch.max_drafts + 2), -1, dtype=torch.long, device=logits.device)
    packed[:, 0] = first + 1
    packed[layout.request[emitted], layout.index[emitted] + 1] = token[emitted]
    return SampleOutput(packed)
