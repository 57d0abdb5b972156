"""The target engine: model + KV cache + slots, the step API (prefill / decode / verify) the verifier builds
on, CUDA graphs for the decode and verify steps, and target-only `generate()` with continuous batching."""

from __future__ import annotations

import bisect
import contextlib
import functools
import secrets
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from specwire import round_trace
from specwire.config import ModelConfig
from specwire.kernels.ops import follow_sampler
from specwire.kernels.rejection_sampler import rejection_sample
from specwire.model import KVCache, LlamaModel, ModelOutput
from specwire.model_source import load_model
from specwire.sampling_params import SamplingParams
from specwire.staging import TORCH_DTYPES, HostArray, StagedInputs, host_array, upload
from specwire.tokenizer import IncrementalDetokenizer, Tokenizer

DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
    "fp32": torch.float32, "float32": torch.float32,
}


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def parse_device(name: str | torch.device) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"invalid device {str(name)!r}") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(name)!r} requested but CUDA is not available")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {str(name)!r} (cpu or cuda)")
    if device.type == "cuda" and device.index is None:  # as its tensors report it: "cuda" != "cuda:0"
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def device_scope(device: torch.device) -> contextlib.AbstractContextManager:
    """Make `device` current: Triton launches and CUDA-graph capture use the current device, not the
    tensors' one, so a model on cuda:1 would otherwise launch on (or capture from) cuda:0."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def on_own_device(method: Callable) -> Callable:
    """Run a method of an object with a `.device` inside device_scope(self.device)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with device_scope(self.device):
            return method(self, *args, **kwargs)

    return wrapper


def device_and_dtype(
    device: str | torch.device | None, dtype: str | torch.dtype | None
) -> tuple[torch.device, torch.dtype]:
    """The --device and --dtype flags resolved: cuda when available, bf16 on CUDA and fp32 on the CPU."""
    resolved = parse_device(device if device is not None else default_device())
    return resolved, parse_dtype(dtype) if dtype is not None else default_dtype(resolved)


def capture(graph: torch.cuda.CUDAGraph, pool=None) -> torch.cuda.graph:
    """torch.cuda.graph on a fresh stream of the current device. torch's default capture stream is one per
    process, made on whichever device captured first, and entering it makes that device current: a model on
    a second GPU of the same process would then launch its Triton kernels against the first one."""
    return torch.cuda.graph(graph, pool=pool, stream=torch.cuda.Stream())


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r} (choose from {', '.join(DTYPES)})")
    return DTYPES[name]


@dataclass
class StepOutput:
    """One step's results. logits are float32 and owned by the caller (never a CUDA-graph buffer)."""

    logits: torch.Tensor  # prefill: [num_requests, V] at each last prompt token; decode/verify: [N, V]
    hidden: torch.Tensor  # [N, H] final normed hidden state of every fed token, requests concatenated
    aux_hidden: torch.Tensor | None  # [N, len(aux_layers) * H] or None


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    stats: dict[str, float] = field(default_factory=dict)  # tokens, seconds, tokens_per_s


def warm_up_widths(max_context: int) -> list[int]:
    """Eager forward widths that compile every kernel variant a step can pick (attention has one tile for up
    to 64 query rows and one for more; the width itself is not specialised), run once at start-up so that no
    request waits on Triton mid-serving: 1, 2, 4, ..., 128 tokens, within the context."""
    return [n for n in (2**i for i in range(8)) if n <= max_context]


def capture_sizes(max_batch: int) -> list[int]:
    """Batch sizes with a decode graph: powers of two below max_batch, then max_batch itself."""
    sizes, size = [], 1
    while size < max_batch:
        sizes.append(size)
        size *= 2
    return [*sizes, max_batch]


def carrying_capture_sizes(max_batch: int, carry_rows: int) -> list[int]:
    """Row counts with a verification graph when prompts ride verifications (carry_rows more rows than
    requests): capture_sizes(max_batch), then every 16th row count above 16 up to max_batch + carry_rows. A
    batch of 16 with a prompt of 160 tokens in rows of 5 is 48 rows: padded to 48, not to 64."""
    return sorted({*capture_sizes(max_batch), *range(32, max_batch + carry_rows, 16), max_batch + carry_rows})


def prefill_capture_sizes(max_rows: int) -> list[int]:
    """Row counts with a prefill graph: 1, 2, 4, 8, then every 4th up to max_rows. A prefill's forward is
    compute-bound, so every padded row costs what a live one does; powers of two would pad up to half."""
    return sorted({*(s for s in (1, 2, 4, 8) if s < max_rows), *range(8, max_rows, 4), max_rows})


# Tokens a row of a prefill forward feeds: prompts are cut into rows this wide (PrefillRows), so that any mix
# of prompts fits a few captured grids. At 64 a prompt pads fewer than 64 tokens.
PREFILL_ROW = 64
PREFILL_GRAPH_TOKENS = 2048  # cells of the largest prefill graph: 32 rows


@dataclass(frozen=True)
class PrefillRows:
    """Prompts cut into rows of `width` tokens, each feeding its slot from its own start position. The rows of
    one prompt in one forward are its causal prefill: every layer writes all rows' keys and values into the
    cache before any row attends (model.Attention), and a row attends to its slot's positions before its
    last. So one captured grid of rows x width serves any mix of prompts."""

    slots: list[int]
    starts: list[int]
    counts: list[int]  # tokens a row feeds (its first counts[r] cells)
    tokens: np.ndarray  # [rows, width] int64, zero past each row's count
    last_rows: list[int]  # per prompt: the row holding its last token
    cells: list[int]  # per prompt token, prompts in order: its cell, row * width + column

    def columns(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """start_pos, num_tokens and slots: a forward's row metadata, int32 on `device`."""
        return tuple(torch.tensor(v, dtype=torch.int32, device=device)  # type: ignore[return-value]
                     for v in (self.starts, self.counts, self.slots))

    def chunks(self, max_rows: int) -> list[PrefillRows]:
        """Consecutive rows, at most max_rows a forward, each chunk with its own last_rows and cells (only
        the prompts ending in it, only its tokens, renumbered). Fed in order they are the prefill: a prompt
        cut across chunks attends to the keys its earlier rows left in the cache. Concatenating the chunks'
        picks gives the whole grid's, in prompt and token order."""
        width, out = self.tokens.shape[1], []
        for first in range(0, len(self.slots), max_rows):
            last = min(first + max_rows, len(self.slots))
            ends, cells = within(self.last_rows, first, last), within(self.cells, first * width, last * width)
            out.append(PrefillRows(
                self.slots[first:last], self.starts[first:last], self.counts[first:last],
                self.tokens[first:last], [r - first for r in ends], [c - first * width for c in cells]))
        return out


def within(rising: list[int], low: int, high: int) -> list[int]:
    """The values of a rising list in [low, high), found by bisection."""
    return rising[bisect.bisect_left(rising, low):bisect.bisect_left(rising, high)]


def prefill_rows(requests: Sequence[tuple[int, Sequence[int]]], width: int,
                 first: Sequence[int] | None = None) -> PrefillRows:
    """first[i]: the position request i's tokens start at (default 0: whole prompts)."""
    slots, starts, counts, last_rows, cells, pieces = [], [], [], [], [], []
    for i, (slot, ids) in enumerate(requests):
        for start in range(0, len(ids), width):
            row, piece = len(slots), ids[start:start + width]
            slots.append(slot)
            starts.append(start + (first[i] if first else 0))
            counts.append(len(piece))
            pieces.append(piece)
            cells.extend(range(row * width, row * width + len(piece)))
        last_rows.append(len(slots) - 1)
    tokens = np.zeros((len(slots), width), dtype=np.int64)
    for row, piece in enumerate(pieces):
        tokens[row, :len(piece)] = piece
    return PrefillRows(slots, starts, counts, tokens, last_rows, cells)


def write_drafts(ids: torch.Tensor, counts: Sequence[int], drafts: torch.Tensor) -> None:
    """ids[b, 1:counts[b]] = row b's drafts, the rows concatenated in `drafts` (already on ids' device),
    written there without a wait for the host: where every row has as many (drafts read on the device), one
    strided copy; else one index copy (a batch-16 round spent 0.17 ms building and uploading that index,
    bench/results/session38/)."""
    rows = len(counts)
    if len(set(counts)) == 1:
        ids[:rows, 1:counts[0]].copy_(drafts.reshape(rows, counts[0] - 1))
        return
    flat = torch.tensor([b * ids.shape[1] + j for b, n in enumerate(counts) for j in range(1, n)])
    ids.view(-1).index_copy_(0, upload(flat, ids.device), drafts)


# forward(input_ids [B, T], start_pos [B], num_tokens [B], slots [B], logits_index [B] or None): a captured
# step's body (the target model, or the drafter's head), over static buffers.
StepForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], Any]


class StepGraphs:
    """CUDA graphs of a step feeding up to `width` tokens per row (1: decode; 1 + k: verify; PREFILL_ROW:
    prefill), one per batch size, sharing static input buffers and a memory pool.

    A batch is padded to the next captured size and each row to `width` tokens; pad rows feed 0 tokens at
    position 0 of the trash slot, rewritten before every replay so no stale metadata reaches the kernels.
    Logits come out for every (row, token) of the grid, or (last_logits) at each row's last fed token;
    callers pick the live ones.
    """

    def __init__(self, forward: StepForward, device: torch.device, trash_slot: int, max_batch: int,
                 width: int, pool=None, last_logits: bool = False, sizes: list[int] | None = None):
        """sizes: the batch sizes to capture (default capture_sizes(max_batch))."""
        self.sizes, self.width, self.last_logits = sizes or capture_sizes(max_batch), width, last_logits
        self.trash = trash_slot
        n = self.sizes[-1]
        # A step's inputs are written on the host and go over in one non-blocking copy.
        fields = {"input_ids": ((n, width), torch.int64), "start_pos": ((n,), torch.int32),
                  "num_tokens": ((n,), torch.int32), "slots": ((n,), torch.int32)}
        if last_logits:
            fields["logits_index"] = ((n,), torch.int64)
        self._inputs = StagedInputs(fields, device)
        self.input_ids, self.start_pos, self.num_tokens, self.slots = list(self._inputs.tensors.values())[:4]
        self.slots.fill_(self.trash)
        self._inputs.host["slots"][:] = self.trash
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Any] = {}

        def step(size: int) -> Any:
            index = self._inputs.tensors["logits_index"][:size] if last_logits else None
            return forward(self.input_ids[:size], self.start_pos[:size], self.num_tokens[:size],
                           self.slots[:size], index)

        with device_scope(device):
            step(n)  # warm-up outside capture: compiles the Triton kernels; all rows are padding
            torch.cuda.synchronize()
            for size in reversed(self.sizes):  # largest first, so smaller graphs reuse its pool memory
                graph = torch.cuda.CUDAGraph()
                with capture(graph, pool):
                    self.outputs[size] = step(size)
                pool = graph.pool()
                self.graphs[size] = graph
            torch.cuda.synchronize()
        self.pool = pool

    def fits(self, batch: int, width: int) -> bool:
        return batch <= self.sizes[-1] and width <= self.width

    def replay_rows(self, rows: PrefillRows) -> Any:
        """prepare + replay for prompts cut into rows of this graph's width."""
        size = self.prepare(torch.tensor(rows.slots, dtype=torch.int32), torch.from_numpy(rows.tokens),
                            torch.tensor(rows.counts, dtype=torch.int32),
                            torch.tensor(rows.starts, dtype=torch.int32))
        return self.replay(size)

    def prepare(self, slots: HostArray, tokens: HostArray, num_tokens: HostArray, positions: HostArray
                ) -> int:
        """tokens [b, <= width] (row b's first num_tokens[b] are live): write the batch into the host block,
        pad it (pad rows -> trash slot) and start its copy to the static buffers; returns the graph size to
        replay. numpy arrays are cheapest, then host tensors (device ones are read back first)."""
        b, w = tokens.shape
        size = next(s for s in self.sizes if s >= b)
        self._inputs.wait_free()
        ids, start_pos, counts, slot_ids = list(self._inputs.host.values())[:4]
        ids[:b, :w] = host_array(tokens)
        ids[:b, w:] = 0
        start_pos[:b] = host_array(positions)
        counts[:b] = host_array(num_tokens)
        slot_ids[:b] = host_array(slots)
        ids[b:size], start_pos[b:size], counts[b:size], slot_ids[b:size] = 0, 0, 0, self.trash
        if self.last_logits:  # pad rows (0 tokens) point at their first cell
            index = self._inputs.host["logits_index"]
            index[:size] = np.arange(size) * self.width + np.maximum(counts[:size] - 1, 0)
        self._inputs.send()
        return size

    def replay(self, size: int) -> Any:
        """Replay; the returned output buffers are overwritten by the next replay."""
        self.graphs[size].replay()
        return self.outputs[size]


class TargetEngine:
    """The target model with a slot-indexed KV cache.

    Step API (the verifier's building blocks): `allocate_slot` / `free_slot`, `prefill`, `decode`,
    `verify`. Requests join and leave between steps. `generate` runs target-only decoding on top of it.
    """

    def __init__(
        self,
        model_path: str | None = None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        max_slots: int = 8,
        max_context: int | None = None,
        cuda_graphs: bool = True,
        aux_layers: tuple[int, ...] = (),
        max_prefill_tokens: int = 8192,
        max_verify_tokens: int = 1,
        checkpoint: tuple[ModelConfig, dict[str, torch.Tensor]] | None = None,
        prefill_graph_tokens: int = PREFILL_GRAPH_TOKENS,
        carry_rows: int = 0,
        carry_width: int = 5,
    ):
        """max_context: cache positions per slot (default min(2048, max_position_embeddings)).
        max_verify_tokens: 1 + k, the widest verify row captured in CUDA graphs (1: decode graphs only).
        prefill_graph_tokens: cells (rows of PREFILL_ROW tokens) of the largest prefill graph; a prefill
        cut into more rows runs eagerly, as every prefill does at 0. An eager prefill of a small model is
        hundreds of kernel launches from Python (SmolLM2 on the H200: 13-25 ms a step, for about 1 ms of GPU
        work); a replay is one.
        model_path may name a synthetic model (`synthetic:NAME`, specwire.synthetic). checkpoint=(config,
        state_dict) uses those weights instead of loading model_path; such an engine has no tokenizer and
        offers the step API only.
        carry_rows, carry_width: a verification may carry whole prompts (verify's `prompts`) cut into rows
        of carry_width tokens, up to carry_rows rows beyond max_slots; graphs at least that wide are captured
        at up to max_slots + carry_rows rows. 0: no verification carries prompts."""
        self.device, self.dtype = device_and_dtype(device, dtype)
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        if carry_rows < 0 or (carry_rows and carry_width < 2):
            raise ValueError(f"carry_rows must be >= 0 and carry_width >= 2, got {carry_rows}, {carry_width}")
        self.tokenizer: Tokenizer | None = None
        if checkpoint is None:
            config, state_dict, self.tokenizer, _ = load_model(model_path, self.device, self.dtype)
        else:
            config, state_dict = checkpoint
        if max_context is None:
            max_context = min(2048, config.max_position_embeddings)
        if max_context < 2:
            raise ValueError(f"max_context must be >= 2, got {max_context}")
        if max_context > config.max_position_embeddings:
            raise ValueError(
                f"max_context={max_context} exceeds the model's max_position_embeddings="
                f"{config.max_position_embeddings}"
            )
        self.config = config
        self.max_context = max_context
        self.max_prefill_tokens = max_prefill_tokens
        self.carry_rows, self.carry_width = carry_rows, carry_width
        self.aux_layers = tuple(aux_layers)
        self.model = LlamaModel(config, self.dtype, self.device, max_positions=max_context)
        self.model.load_weights(state_dict)
        del state_dict
        self.cache = KVCache.allocate(config, max_slots, max_context, self.dtype, self.device)
        self.max_slots = max_slots
        self._free_slots = list(range(max_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.graphs: list[StepGraphs] = []  # narrowest first: a step replays the first that fits
        self.step_replayed_graph = False  # whether the last decode/verify step was a graph replay
        self.prefill_graphs: StepGraphs | None = None
        if cuda_graphs and self.device.type == "cuda":
            def forward(ids, start_pos, num_tokens, slots, logits_index) -> ModelOutput:
                return self.model(ids, start_pos, num_tokens, slots, self.cache, logits_index=logits_index,
                                  aux_layers=self.aux_layers)

            pool, trash = None, self.cache.trash_slot
            widths = {1, max_verify_tokens, *([carry_width] if carry_rows else [])}
            for width in sorted(widths):
                carrying = carry_rows and width >= carry_width
                sizes = carrying_capture_sizes(max_slots, carry_rows) if carrying else None
                graphs = StepGraphs(forward, self.device, trash, max_slots, width, pool, sizes=sizes)
                self.graphs.append(graphs)
                pool = graphs.pool
            if prefill_graph_tokens >= PREFILL_ROW:
                rows = prefill_graph_tokens // PREFILL_ROW
                self.prefill_graphs = StepGraphs(forward, self.device, trash, rows, PREFILL_ROW, pool,
                                                 last_logits=True, sizes=prefill_capture_sizes(rows))
            if self.prefill_graphs is None:  # prefills run eagerly: compile their kernels now
                with device_scope(self.device):  # into slot 0: free, and a prefill rewrites it from 0
                    for n in warm_up_widths(max_context):
                        self._prefill_chunk(prefill_rows([(0, [0] * n)], n), graph=False)
        if self.device.type == "cuda" and max_verify_tokens > 1:  # follow_sampler's kernel: compiled now,
            with device_scope(self.device):  # not in the first round a request waits on
                ids = torch.zeros(1, max_verify_tokens, dtype=torch.int64, device=self.device)
                follow_sampler(ids, torch.zeros(1, dtype=torch.int32, device=self.device),
                               torch.ones(1, max_verify_tokens + 1, dtype=torch.int64, device=self.device),
                               self.config.vocab_size)

    # ------------------------------------------------------------------------------------------ slots

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def allocate_slot(self) -> int:
        if not self._free_slots:
            raise RuntimeError(f"all {self.max_slots} KV-cache slots are in use")
        return self._free_slots.pop()

    def free_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_slots or slot in self._free_slots:
            raise ValueError(f"slot {slot} is not allocated")
        self._free_slots.append(slot)

    # ------------------------------------------------------------------------------------------ steps

    def check_token_ids(self, token_ids: Sequence[int]) -> None:
        vocab = self.config.vocab_size
        if bad := [t for t in token_ids if not 0 <= t < vocab]:
            raise ValueError(f"token id {bad[0]} out of range [0, {vocab})")

    @on_own_device
    def prefill(self, requests: Sequence[tuple[int, Sequence[int]]]) -> StepOutput:
        """Feed whole prompts [(slot, token ids)] from position 0, cut into rows of PREFILL_ROW tokens
        (PrefillRows) and fed prefill_rows_per_forward rows a forward. logits: [len(requests), V] at each last
        prompt token; hidden/aux: every prompt token, requests concatenated in order."""
        if not requests:
            raise ValueError("prefill needs at least one request")
        self._check_prompts(requests)
        grid = prefill_rows(requests, PREFILL_ROW)
        outs = [self._prefill_chunk(chunk) for chunk in grid.chunks(self.prefill_rows_per_forward)]
        return StepOutput(torch.cat([o.logits for o in outs]), torch.cat([o.hidden for o in outs]),
                          torch.cat([o.aux_hidden for o in outs]) if self.aux_layers else None)

    def _check_prompts(self, requests: Sequence[tuple[int, Sequence[int]]]) -> None:
        for slot, ids in requests:
            if not 0 < len(ids) <= self.max_context:
                raise ValueError(f"prompt of {len(ids)} tokens does not fit the context "
                                 f"(1..{self.max_context})")
            if not 0 <= slot < self.max_slots:
                raise ValueError(f"slot {slot} out of range [0, {self.max_slots})")
            self.check_token_ids(ids)

    @property
    def prefill_rows_per_forward(self) -> int:
        """Rows of PREFILL_ROW tokens a prefill forward holds: the largest prefill graph's, else as many as
        max_prefill_tokens allows."""
        if self.prefill_graphs is not None:
            return self.prefill_graphs.sizes[-1]
        return max(1, self.max_prefill_tokens // PREFILL_ROW)

    def _prefill_chunk(self, rows: PrefillRows, graph: bool = True) -> StepOutput:
        """One forward over rows (a chunk of a prefill): logits at the last token of each prompt ending in
        it, hidden and aux at its tokens. By graph replay when there are prefill graphs."""
        if graph and self.prefill_graphs is not None:
            out = self.prefill_graphs.replay_rows(rows)
            last = torch.tensor(rows.last_rows, dtype=torch.int64)  # the graph's logits: each row's last cell
        else:
            w = rows.tokens.shape[1]
            last_cells = torch.tensor([r * w + rows.counts[r] - 1 for r in rows.last_rows], dtype=torch.int64)
            out = self.model(torch.from_numpy(rows.tokens).to(self.device), *rows.columns(self.device),
                             self.cache, logits_index=last_cells.to(self.device), aux_layers=self.aux_layers)
            last = torch.arange(len(rows.last_rows))
        index = upload(torch.cat([last, torch.tensor(rows.cells, dtype=torch.int64)]), self.device)
        last, cells = index[:len(rows.last_rows)], index[len(rows.last_rows):]  # one copy for both picks
        hidden = out.hidden.flatten(0, 1).index_select(0, cells)
        aux = out.aux_hidden.flatten(0, 1).index_select(0, cells) if out.aux_hidden is not None else None
        return StepOutput(out.logits.index_select(0, last), hidden, aux)

    @on_own_device
    def decode(
        self, slots: Sequence[int] | torch.Tensor, last_tokens: Sequence[int] | torch.Tensor,
        positions: Sequence[int] | torch.Tensor,
    ) -> StepOutput:
        """One token per request: last_tokens[b] at absolute position positions[b] of slot slots[b].
        Replays a CUDA graph when the engine has them and the batch fits; eager otherwise."""
        slots_t = self._step_input(slots, np.int32)
        tokens_t = self._step_input(last_tokens, np.int64)
        positions_t = self._step_input(positions, np.int32)
        b = slots_t.shape[0]
        out = self._step(slots_t, tokens_t[:, None], np.ones(b, dtype=np.int32), positions_t)
        aux = out.aux_hidden[:b, 0].clone() if out.aux_hidden is not None else None
        return StepOutput(out.logits[:b].clone(), out.hidden[:b, 0].clone(), aux)

    @on_own_device
    def verify(
        self, slots: Sequence[int], token_lists: Sequence[Sequence[int]], start_positions: Sequence[int],
        device_drafts: torch.Tensor | None = None, prompts: Sequence[tuple[int, Sequence[int]]] = (),
        follow: torch.Tensor | None = None,
    ) -> StepOutput:
        """Row b feeds token_lists[b] = [last token, d_1..d_k] at start_positions[b]...; returns logits,
        hidden and aux for every fed token, rows concatenated: [sum(1 + k_b), ...]. device_drafts: every
        row's drafts concatenated [sum k_b], on a device (this one or a drafter's), in place of
        token_lists[b][1:] (which then only give each row's length): drafts made on the device are fed
        without a wait for the host. They are the verifier's own drafter's, not checked against the
        vocabulary.

        prompts [(slot, token ids)]: whole prompts prefilled by the same forward, from position 0, in rows of
        carry_width tokens after the verification's (one weight read for both: a lone prompt's prefill costs
        a forward of its own). Their logits follow the verification's, one per prompt at its last token, and
        their hidden and aux rows follow, every prompt token in order.

        follow: a sampler's output on this device ([B, 2 + k], SampleOutput.packed) for these rows, whose
        tokens the host has not read yet: row b starts with the last token it emitted (token_lists[b][0] is
        then a placeholder), at start_positions[b] advanced by their count (follow_sampler)."""
        counts = [len(t) for t in token_lists]
        if not counts or min(counts) < 1:
            raise ValueError("verify needs at least one token per row")
        if follow is not None and (follow.shape[0] != len(counts) or prompts):
            raise ValueError(f"follow must have a row per verified row ({len(counts)}) and no prompts "
                             f"beside, got {list(follow.shape)} and {len(prompts)} prompts")
        if device_drafts is None:
            for tokens in token_lists:
                self.check_token_ids(tokens)
        else:
            self.check_token_ids([tokens[0] for tokens in token_lists])
            if device_drafts.shape != (num_drafts := sum(counts) - len(counts),):
                raise ValueError(f"device_drafts must be [{num_drafts}], got {list(device_drafts.shape)}")
        carried = self._carried_grid(prompts)
        width = max(counts + ([carried.tokens.shape[1]] if carried else []))
        ids = np.zeros((len(counts) + len(carried.slots if carried else []), width), dtype=np.int64)
        for b, tokens in enumerate(token_lists):
            ids[b, :len(tokens)] = tokens
        row_counts, row_slots, row_starts = counts, list(slots), list(start_positions)
        if carried:
            ids[len(counts):, :carried.tokens.shape[1]] = carried.tokens
            row_counts, row_slots = counts + carried.counts, row_slots + carried.slots
            row_starts = row_starts + carried.starts
        out = self._step(
            self._step_input(row_slots, np.int32),
            ids,
            np.array(row_counts, dtype=np.int32),
            self._step_input(row_starts, np.int32),
            None if device_drafts is None
            else (counts, device_drafts.to(self.device, torch.int64, non_blocking=True)),
            follow,
        )
        # Graph outputs have the captured grid's row stride; eager ones the batch's own. When every row is
        # full (and nothing is carried) the fed tokens lead the grid, and a slice (cloned: graph buffers are
        # reused) picks them.
        stride, fed = out.hidden.shape[1], sum(counts)
        if fed == len(counts) * stride and not carried:
            logits_index = hidden_index = None
        else:
            cells = [i * stride + j for i, n in enumerate(counts) for j in range(n)]
            if carried:
                base, w = len(counts) * stride, carried.tokens.shape[1]
                # the carried grid's cells in this grid
                to_grid = [base + (c // w) * stride + c % w for c in carried.cells]
                last = [base + r * stride + carried.counts[r] - 1 for r in carried.last_rows]
                index = upload(torch.tensor(cells + last + cells + to_grid), self.device)  # one copy for both
                logits_index, hidden_index = index[:fed + len(last)], index[fed + len(last):]
            else:
                logits_index = hidden_index = upload(torch.tensor(cells), self.device)

        def pick(t: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
            return t[:fed].clone() if index is None else t[index]

        aux = pick(out.aux_hidden.flatten(0, 1), hidden_index) if out.aux_hidden is not None else None
        return StepOutput(pick(out.logits, logits_index), pick(out.hidden.flatten(0, 1), hidden_index), aux)

    def _carried_grid(self, prompts: Sequence[tuple[int, Sequence[int]]]) -> PrefillRows | None:
        """Prompts a verification carries, checked and cut into rows of carry_width (None: none)."""
        if not prompts:
            return None
        if not self.carry_rows:
            raise ValueError("this engine carries no prompts in verifications (carry_rows=0)")
        self._check_prompts(prompts)
        return prefill_rows(prompts, self.carry_width)

    def carry_fits(self, prompt_lengths: Sequence[int], batch: int) -> bool:
        """Whether prompts of these lengths, cut into rows of carry_width, fit beside a verification of
        `batch` rows in the largest graph (carrying_capture_sizes)."""
        rows = sum(-(-n // self.carry_width) for n in prompt_lengths)
        return rows <= self.max_slots + self.carry_rows - batch

    def _step(
        self, slots: HostArray, tokens: HostArray, num_tokens: HostArray, positions: HostArray,
        on_device: tuple[list[int], torch.Tensor] | None = None, follow: torch.Tensor | None = None,
    ) -> ModelOutput:
        """One decode/verify step: replays the narrowest CUDA graph that fits, else runs eagerly. Inputs are
        best on the host, as numpy: a graph sends them over in one copy, the eager path moves them. on_device:
        (each row's token count, its drafts on the device) written over the rows' drafts once moved; follow:
        a sampler's output the rows continue from (verify)."""
        graphs = self.graphs_for(*tokens.shape)
        self.step_replayed_graph = graphs is not None
        if graphs is not None:
            size = graphs.prepare(slots, tokens, num_tokens, positions)
            round_trace.mark("e.prepared")
            if follow is not None:  # queued behind prepare's copy, as the drafts are
                follow_sampler(graphs.input_ids, graphs.start_pos, follow, self.config.vocab_size)
            if on_device is not None:  # queued behind prepare's copy of the host's ids
                write_drafts(graphs.input_ids, *on_device)
                round_trace.mark("e.drafts_written")
            replayed = graphs.replay(size)
            round_trace.mark("e.replayed")
            return replayed
        def moved(values: HostArray) -> torch.Tensor:
            return torch.as_tensor(values).to(self.device)

        tokens, positions = moved(tokens), moved(positions)
        if follow is not None:
            follow_sampler(tokens, positions, follow, self.config.vocab_size)
        if on_device is not None:
            write_drafts(tokens, *on_device)
        return self.model(tokens, positions, moved(num_tokens), moved(slots), self.cache,
                          aux_layers=self.aux_layers)

    def graphs_for(self, batch: int, width: int) -> StepGraphs | None:
        """The narrowest captured graph set that fits a step of batch x width tokens; None: eager."""
        return next((g for g in self.graphs if g.fits(batch, width)), None)

    @staticmethod
    def _step_input(values: Sequence[int] | torch.Tensor, dtype: type) -> HostArray:
        """A step input of numpy `dtype`: a tensor as a tensor of that dtype, left where it is; a list as a
        numpy array (a torch tensor made from a list costs more host time, and the graphs read numpy)."""
        if isinstance(values, torch.Tensor):
            return values.to(dtype=TORCH_DTYPES[np.dtype(dtype)])
        return np.array(values, dtype=dtype)

    # ------------------------------------------------------------------------------------------ generate

    def generate(
        self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]
    ) -> list[GenerationResult]:
        """Target-only decoding with continuous batching: waiting requests are prefilled as soon as slots
        free up (prefill steps take priority), running ones decode together, finished ones leave."""
        if self.tokenizer is None:
            raise ValueError("this engine was built without a tokenizer; generate() needs one")
        if len(prompts) != len(params):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        sequences = [self._new_sequence(list(p), sp) for p, sp in zip(prompts, params, strict=True)]
        waiting, running = deque(sequences), []
        try:
            while waiting or running:
                admitted = self._admit(waiting)
                running += admitted
                if admitted:
                    batch = admitted
                    out = self.prefill([(s.slot, s.prompt) for s in batch])
                else:
                    batch = running
                    out = self.decode([s.slot for s in batch], [s.last_token for s in batch],
                                      [s.length - 1 for s in batch])
                for seq, token in zip(batch, self._sample(out.logits, batch), strict=True):
                    seq.append(token)
                for seq in [s for s in running if s.finish_reason]:
                    self.free_slot(seq.slot)
                    running.remove(seq)
        finally:  # an error mid-way must not leak the slots of unfinished requests
            for seq in running:
                self.free_slot(seq.slot)
        return [s.result() for s in sequences]

    def _new_sequence(self, prompt: list[int], params: SamplingParams) -> _Sequence:
        params.validate(self.config.vocab_size, self.max_context)
        if not prompt:
            raise ValueError("prompt is empty")
        self.check_token_ids(prompt)
        if len(prompt) + params.max_tokens > self.max_context:
            raise ValueError(
                f"prompt of {len(prompt)} tokens + max_tokens={params.max_tokens} exceeds the context "
                f"length {self.max_context}"
            )
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        eos = () if params.ignore_eos else self.tokenizer.eos_token_ids
        return _Sequence(prompt, params, seed, eos, IncrementalDetokenizer(self.tokenizer, params.stop))

    def _admit(self, waiting: deque[_Sequence]) -> list[_Sequence]:
        """Take waiting sequences while slots are free and the prefill budget lasts (at least one)."""
        admitted, budget = [], self.max_prefill_tokens
        while waiting and self._free_slots and (not admitted or len(waiting[0].prompt) <= budget):
            seq = waiting.popleft()
            seq.slot = self.allocate_slot()
            seq.started = time.perf_counter()
            budget -= len(seq.prompt)
            admitted.append(seq)
        return admitted

    def _sample(self, logits: torch.Tensor, batch: Sequence[_Sequence]) -> list[int]:
        """One token per row, through the rejection sampler with no drafts; randomness from (seed,
        absolute position of the sampled token), so a seeded request repeats whatever its batch."""
        out = rejection_sample(  # per-request columns on the CPU: the sampler validates them there
            logits,
            torch.empty(0, dtype=torch.int64),
            torch.zeros(len(batch), dtype=torch.int32),
            None,
            torch.tensor([s.params.temperature for s in batch], dtype=torch.float32),
            torch.tensor([s.params.top_k for s in batch], dtype=torch.int32),
            torch.tensor([s.params.top_p for s in batch], dtype=torch.float32),
            torch.tensor([s.seed for s in batch], dtype=torch.int64),
            torch.tensor([s.length for s in batch], dtype=torch.int64),
            defer_check=True,  # no wait for the device until the one copy back, which also checks
        )
        return [tokens[0] for tokens in out.token_lists()]


class _Sequence:
    """One request inside generate(): its tokens, slot, detokenized text and finish state."""

    def __init__(
        self, prompt: list[int], params: SamplingParams, seed: int, eos_ids: Sequence[int],
        detokenizer: IncrementalDetokenizer,
    ):
        self.prompt, self.params, self.seed, self.eos_ids = prompt, params, seed, set(eos_ids)
        self.detokenizer = detokenizer
        self.output: list[int] = []
        self.slot = -1
        self.started = 0.0
        self.seconds = 0.0
        self.finish_reason: str | None = None

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def last_token(self) -> int:
        return self.output[-1]

    def append(self, token: int) -> None:
        self.output.append(token)
        self.detokenizer.push([token])
        if token in self.eos_ids or self.detokenizer.stopped:
            self.finish_reason = "stop"
        elif len(self.output) >= self.params.max_tokens:
            self.finish_reason = "length"
        if self.finish_reason:
            self.detokenizer.flush()  # the text held back in case it grew into a stop string
            self.seconds = time.perf_counter() - self.started

    def result(self) -> GenerationResult:
        n, seconds = len(self.output), self.seconds
        stats = {"tokens": n, "seconds": seconds, "tokens_per_s": n / seconds if seconds else 0.0}
        return GenerationResult(self.output, self.detokenizer.text, self.finish_reason, stats)
