"""How a speculation-cache verifier's rounds get their drafts, chosen by measured throughput.

Tables (drafted while a verification runs, looked up when it ends) pay when they come in time and hold the
outcome. Where they come late, serial drafting (each round waits for drafts made for its settled tokens) is
faster: 1.4-1.9x on the CPU (bench/results/serial_vs_cache_tiny_cpu/), 0.74x against 0.51x of target-only
for SmolLM2 at batch 16 on two H200s. Where neither pays (sampled SmolLM2 requests across two processes:
tables 0.71x-0.92x, serial 0.44x-0.51x, bench/results/session29/), rounds without drafts ("none") lose least.
Which one wins depends on the models, the batch, the temperature and the drafter's speed, so it is measured:
rounds run in epochs of one mode, an epoch's tokens per request-second updates that mode's estimate, the
fastest mode runs next, and every `explore_every`-th epoch runs one of the others again, in turn. An epoch's
first round is not measured: it pays for the switch (the drafter catching up on the tokens of rounds it was
not told of, a table never drafted), which would fall on whichever mode follows rounds without drafts.
Per request, not per second: a static batch drains as its requests end, and an epoch measured on its tail
would read slow for a reason that is not its mode. (Per request is fair where a round's time barely depends on
its rows, as in the memory-bound batches speculation serves; where rounds grow with the batch, a small tail
reads a little fast instead.)
"""

from __future__ import annotations

from specwire.metrics import DRAFTING_MODES as MODES  # ("tables", "serial", "none"): the metric's labels

# A speculation-cache verifier's default epoch (--drafting-epoch): long enough to measure, short enough that a
# bench point of a few hundred rounds tries every mode. The best mode or within 0.04x of it at every point of
# two runs (SmolLM2 + shipped head, two H200s, batch 1 / 16 / 64, T = 0 and 1: bench/results/session31/).
DEFAULT_EPOCH_ROUNDS = 16


class DraftingMode:
    def __init__(self, epoch_rounds: int, explore_every: int = 8):
        if epoch_rounds < 1 or explore_every < 2:
            raise ValueError(f"epoch_rounds must be >= 1 and explore_every >= 2, got {epoch_rounds}, "
                             f"{explore_every}")
        self.epoch_rounds, self.explore_every = epoch_rounds, explore_every
        self.mode = "tables"
        self.rate: dict[str, float | None] = dict.fromkeys(MODES)  # tokens per request-second, per mode
        self._epochs = self._rounds = self._tokens = self._explored = 0
        self._request_seconds = 0.0

    def record(self, tokens: int, requests: int, seconds: float) -> None:
        """A round of the current mode for `requests` requests settled `tokens` in `seconds`: its own time,
        from its start (waits for its drafts included) to its tokens, and not the prefill steps or the idle
        time between rounds, which would fall on whichever mode runs when a batch ends or a request comes."""
        self._rounds += 1
        if self._rounds > 1 or self.epoch_rounds == 1:  # an epoch's first round pays the switch
            self._tokens += tokens
            self._request_seconds += requests * seconds
        if self._rounds < self.epoch_rounds:
            return
        rate = self._tokens / max(self._request_seconds, 1e-9)
        old = self.rate[self.mode]
        self.rate[self.mode] = rate if old is None else 0.5 * (old + rate)
        self._epochs += 1
        self._rounds = self._tokens = 0
        self._request_seconds = 0.0
        self.mode = self._next()

    def _next(self) -> str:
        unmeasured = [m for m in MODES if self.rate[m] is None]
        if unmeasured:
            return unmeasured[0]
        best, *others = sorted(MODES, key=lambda m: self.rate[m], reverse=True)
        if self._epochs % self.explore_every:
            return best
        self._explored += 1
        return others[(self._explored - 1) % len(others)]
