"""How a speculation-cache verifier's rounds get their drafts, chosen by measured throughput.

Tables (drafted while a verification runs, looked up when it ends) pay when they come in time and hold the
outcome. Where they come late, serial drafting (each round waits for drafts made for its settled tokens) is
faster: 1.4-1.9x on the CPU (bench/results/serial_vs_cache_tiny_cpu/), 0.74x against 0.51x of target-only
for SmolLM2 at batch 16 on two H200s. Where neither pays (sampled SmolLM2 requests across two processes:
tables 0.71x-0.92x, serial 0.44x-0.51x, bench/results/session29/), rounds without drafts ("none") lose least.
Which one wins depends on the models, the batch, the temperature and the drafter's speed, so it is measured:
rounds run in epochs of one mode, an epoch's tokens per request-second updates that mode's estimate, the
fastest mode runs next, and each of the others runs again once its gap has passed: `explore_every` epochs
after it last ran, doubled each time a retry finds it still slower (up to `max_gap`), back to `explore_every`
once it has been the fastest. A mode that keeps losing then costs about one epoch in `max_gap`, not one in
`explore_every`, and one that got faster is still found within `max_gap` epochs. (Retried every 8th epoch, the
losing modes ran 12-19% of the rounds for SmolLM2 at T = 1 on two H200s, where rounds without drafts won and a
serial round took 5.1-5.4 ms for 1.9 tokens against 1.2-1.5 ms a target-only token: bench/results/session31/.)
An epoch's first round is not measured: it pays for the switch (the drafter catching up on the tokens of
rounds it was not told of, a table never drafted), which would fall on whichever mode follows rounds without
drafts.
Per request, not per second: a static batch drains as its requests end, and an epoch measured on its tail
would read slow for a reason that is not its mode. (Per request is fair where a round's time barely depends on
its rows, as in the memory-bound batches speculation serves; where rounds grow with the batch, a small tail
reads a little fast instead.)
"""

from __future__ import annotations

import logging

from specwire.metrics import DRAFTING_MODES as MODES  # ("tables", "serial", "none"): the metric's labels

log = logging.getLogger("specwire.verifier")

# A remote drafter's verifier's default epoch (--drafting-epoch): long enough to measure, short enough that a
# bench point of a few hundred rounds tries every mode. The best mode or within 0.04x of it at every point of
# two runs (SmolLM2 + shipped head, two H200s, batch 1 / 16 / 64, T = 0 and 1: bench/results/session31/;
# measured before session 34's serial epochs queued their drafts, not since).
DEFAULT_EPOCH_ROUNDS = 16

# The modes where serial drafts are queued on the drafter's device behind each sampler (a same-host drafter
# process that maps the features): a queued serial round beat the rounds with tables, SmolLM2 over the step
# socket on two H200s, T = 0, serial alone 1.47x-1.57x / 1.36x-1.40x of target-only against 1.33x-1.46x /
# 1.15x-1.22x for all three modes (batch 1 / 16, three runs; bench/results/session35/). Rounds without drafts
# stay in: sampled requests there ran at 0.73x / 0.53x serially, 1.00x / 0.78x mostly without drafts.
QUEUED_MODES = ("serial", "none")


def check_modes(modes: tuple[str, ...], name: str) -> None:
    """Raises ValueError, naming `name`, unless `modes` are one or more distinct ones of MODES."""
    if not modes or len(set(modes)) != len(modes) or not set(modes) <= set(MODES):
        raise ValueError(f"{name} must be distinct ones of {', '.join(MODES)}, got {modes}")


class DraftingMode:
    def __init__(self, epoch_rounds: int, explore_every: int = 8, max_gap: int = 64,
                 modes: tuple[str, ...] = MODES):
        """modes: those taking part, the first run first."""
        if epoch_rounds < 1 or explore_every < 2 or max_gap < explore_every:
            raise ValueError(f"epoch_rounds must be >= 1, explore_every >= 2 and max_gap >= explore_every, "
                             f"got {epoch_rounds}, {explore_every}, {max_gap}")
        check_modes(modes, "modes")
        self.epoch_rounds, self.explore_every, self.max_gap = epoch_rounds, explore_every, max_gap
        self.modes, self.mode = modes, modes[0]
        self.rate: dict[str, float | None] = dict.fromkeys(modes)  # tokens per request-second, per mode
        self._last = dict.fromkeys(modes, 0)  # the epoch each mode last ran in
        self._gap = dict.fromkeys(modes, explore_every)  # epochs from a mode's last run to its next retry
        self._retrying = False  # the current epoch runs a mode that was not the fastest
        self._epochs = self._rounds = self._tokens = 0
        self._request_seconds = 0.0

    @property
    def last_round_of_epoch(self) -> bool:
        """The next round recorded ends the current epoch (the mode may change after it)."""
        return self._rounds + 1 >= self.epoch_rounds

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
        log.debug("drafting epoch %d: %s, %d tokens in %.2f ms per request, %.0f tokens per request-second",
                  self._epochs, self.mode, self._tokens, 1e3 * self._request_seconds, rate)
        if self._fastest() == self.mode:
            self._gap[self.mode] = self.explore_every
        elif self._retrying:
            self._gap[self.mode] = min(2 * self._gap[self.mode], self.max_gap)
        self._last[self.mode] = self._epochs
        self._epochs += 1
        self._rounds = self._tokens = 0
        self._request_seconds = 0.0
        self.mode = self._next()

    def _fastest(self) -> str:
        return max((m for m in self.modes if self.rate[m] is not None), key=lambda m: self.rate[m])

    def _next(self) -> str:
        unmeasured = [m for m in self.modes if self.rate[m] is None]
        self._retrying = False
        if unmeasured:
            return unmeasured[0]
        best = self._fastest()
        due = [m for m in self.modes if m != best and self._epochs >= self._last[m] + self._gap[m]]
        if not due:
            return best
        self._retrying = True
        return min(due, key=lambda m: (self._last[m] + self._gap[m], -self.rate[m]))  # the longest due first
