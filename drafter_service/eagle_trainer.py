"""The training loop of `specwire train-eagle`: training-time test, soft targets, resumable checkpoints.

Per step: the target recomputes its features on a batch of conversations (token ids only are stored), the
head is unrolled over its own outputs for --ttt-steps draft steps (drafter_service.ttt) and every step j is
scored with weight decay**j against the target's next-token distribution: forward KL, for EAGLE-3 against
the distribution restricted to the draft vocabulary and renormalised, plus --tv-weight x (1 - sum min(p, q)).
EAGLE-1 adds its smooth-L1 regression onto the target's next feature. Batches come in a fixed order per
(seed, epoch), so (epoch, batch index), the optimizer and the random state are the whole training position:
resuming is exact.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from specwire.drafter.chain_visits import anchor_acceptance, chain_metrics, chain_sums, drafted_anchors
from specwire.drafter.draft_vocab import inside_mass, restricted_log_probs, target_argmax
from specwire.drafter.eagle_head import EagleHead, save_eagle_head
from specwire.drafter.self_distill import Conversation, Sample, record_features
from specwire.drafter.train_state import load_train_state, save_train_state
from specwire.drafter.ttt import step_mask, unroll
from tqdm import tqdm

from specwire.engine import TargetEngine

FEATURE_LOSS_WEIGHT, EAGLE1_TOKEN_LOSS_WEIGHT = 1.0, 0.1  # EAGLE-1's v_w and p_w
WARMUP_STEPS = 50
AUTO_PROBE_STEPS = (5, 30)  # --total-steps -1: the step rate measured between these steps of a session
PROXY_K = 4  # the acceptance-length proxy's chain length
# Evaluations also replay the chain over each answer's first tokens only, as many as `specwire bench` and the
# issue's figures take: later tokens of a small target's greedy answers repeat and draft far more easily
# (shipped head, 32 held-out chat questions: 2.73 over 128 tokens, 3.26 over 320; bench/results/session31/).
FIRST_TOKENS = 128
CHAIN_PREFIXES = ("chain_", "first_chain_")  # evaluation sums that are already sums over rounds


@contextlib.contextmanager
def torch_ops() -> Iterator[None]:
    """The reference (differentiable) layer ops; the Triton kernels have no backward."""
    previous, os.environ["SPECWIRE_TORCH_OPS"] = os.environ.get("SPECWIRE_TORCH_OPS"), "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("SPECWIRE_TORCH_OPS")
        else:
            os.environ["SPECWIRE_TORCH_OPS"] = previous


class Trainer:
    def __init__(self, head: EagleHead, engine: TargetEngine, args: argparse.Namespace, cuda: bool):
        self.head, self.engine, self.args, self.cuda = head, engine, args, cuda
        self.batch_tokens = args.batch_tokens or (8192 if cuda else 512)
        self.params = head.trainable_parameters()
        self.optimizer = torch.optim.AdamW(
            list(self.params.values()), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0
        )
        self.step = self.epoch = self.batch_index = 0
        self.total_steps = args.total_steps  # -1: fitted to this invocation's time budget once measured
        self.curve: list[dict] = []  # training losses every --log-every steps
        self.history: list[dict] = []  # held-out evaluations
        self.sessions: list[dict] = []  # one entry per invocation (resumed runs add theirs)
        self._window: Counter = Counter()

    # ------------------------------------------------------------------------------ checkpoints

    def save(self, path: str | Path) -> None:
        meta = {
            "step": self.step,
            "epoch": self.epoch,
            "batch_index": self.batch_index,
            "curve": self.curve,
            "history": self.history,
            "sessions": self.sessions,
        }
        save_train_state(path, self.params, self.optimizer, self.head.draft_to_target, meta)
        # The head so far, loadable as it stands: a run cut off with its machine still leaves a head.
        save_eagle_head(self.head, Path(path).with_name(Path(path).name + "-head"),
                        extra={"target_tokenizer": self.engine.tokenizer.fingerprint, "step": self.step,
                               "held_out": self.last_held_out()})

    def last_held_out(self) -> dict | None:
        """The latest held-out evaluation without its per-source breakdown (None before the first)."""
        if not self.history:
            return None
        return {k: v for k, v in self.history[-1].items() if k not in ("per_source", "per_answer")}

    def restore(self, path: str | Path) -> None:
        meta = load_train_state(path, self.params, self.optimizer, self.head.draft_to_target)
        self.step, self.epoch, self.batch_index = meta["step"], meta["epoch"], meta["batch_index"]
        self.curve, self.history, self.sessions = meta["curve"], meta["history"], meta["sessions"]
        if self.args.total_steps < 0 and meta["total_steps"] > 0:  # keep the schedule the run started with
            self.total_steps = meta["total_steps"]

    # ------------------------------------------------------------------------------ loop

    def fit(
        self,
        train: list[Conversation],
        held: list[Conversation],
        deadline: float,
        checkpoint: Path | None = None,
    ) -> None:
        """Train until the deadline, --total-steps, --stop-after-steps or --epochs; evaluate after each epoch
        and at the end; checkpoint every --checkpoint-every steps and at the end."""
        a = self.args
        first = self.step
        own_stop = first + a.stop_after_steps if a.stop_after_steps else 0
        session = {"from_step": first, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        t0 = probe = time.monotonic()
        bar = tqdm(initial=self.step, desc="train", unit="step")
        stopped = False
        while self.epoch < a.epochs and not stopped:
            order = self._batches(train, self.epoch)
            while self.batch_index < len(order):
                ends = [s for s in (self.total_steps, own_stop) if s > 0]
                if time.monotonic() > deadline or (ends and self.step >= min(ends)):
                    stopped = True
                    break
                self._train_step([train[i] for i in order[self.batch_index]])
                self.batch_index += 1
                bar.update(1)
                if self.step - first == AUTO_PROBE_STEPS[0]:
                    probe = time.monotonic()
                elif self.total_steps < 0 and self.step - first == AUTO_PROBE_STEPS[1]:
                    rate = (AUTO_PROBE_STEPS[1] - AUTO_PROBE_STEPS[0]) / (time.monotonic() - probe)
                    self.total_steps = self.step + int(rate * max(deadline - time.monotonic(), 0))
                    tqdm.write(f"{rate:.2f} steps/s: the schedule ends at step {self.total_steps}")
                if checkpoint and a.checkpoint_every and self.step % a.checkpoint_every == 0:
                    self.save(checkpoint)
            else:
                self.epoch, self.batch_index = self.epoch + 1, 0
                self._evaluate_into_history(held)
        bar.close()
        if not self.history or self.history[-1]["step"] != self.step:
            self._evaluate_into_history(held)
        self.sessions.append({**session, "to_step": self.step, "seconds": round(time.monotonic() - t0, 1)})
        if checkpoint:
            self.save(checkpoint)

    def _evaluate_into_history(self, held: list[Conversation]) -> None:
        self.history.append({"step": self.step, "epoch": self.epoch, **self.evaluate(held)})
        last = self.history[-1]
        proxies = {kind: {k: v for k, v in m.items() if k.startswith(("acceptance", "chain_length"))}
                   for kind, m in last["per_answer"].items()}
        overall = {k: v for k, v in last.items() if not k.startswith("per_")}
        tqdm.write(json.dumps({**overall, "per_answer": proxies}))

    def _batches(self, data: list[Conversation], epoch: int | None) -> list[list[int]]:
        """Length-sorted batches of about batch_tokens padded tokens; shuffled by (seed, epoch) if given."""
        ordered = sorted(range(len(data)), key=lambda i: len(data[i].tokens))
        batches, current = [], []
        for i in ordered:
            width = min(len(data[i].tokens), self.args.max_seq_len)
            if current and width * (len(current) + 1) > self.batch_tokens:
                batches.append(current)
                current = []
            current.append(i)
        if current:
            batches.append(current)
        if epoch is not None:
            random.Random(self.args.seed * 100_003 + epoch).shuffle(batches)
        return batches

    def lr(self) -> float:
        """Linear warm-up, then cosine to a tenth over the total steps (constant while there are none)."""
        warm = min(1.0, (self.step + 1) / WARMUP_STEPS)
        total = max(self.total_steps, 0)
        progress = min(self.step / total, 1.0) if total else 0.0
        return self.args.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    def _train_step(self, batch: list[Conversation]) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr()
        samples = record_features(self.engine, batch)  # Triton kernels where available, no grad
        with torch_ops(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.cuda):
            losses = self._losses(samples, noise=self.args.feature_noise)
            self.optimizer.zero_grad(set_to_none=True)
            losses["loss"].backward()
        torch.nn.utils.clip_grad_norm_(list(self.params.values()), 0.5)
        self.optimizer.step()
        self.step += 1
        n = float(losses["positions"])
        self._window["n"] += n
        for k, v in losses.items():
            if k not in ("loss", "positions"):
                self._window[k] += float(v) * n
        if self.step % self.args.log_every == 0:
            self.curve.append(
                {
                    "step": self.step,
                    "epoch": self.epoch,
                    "lr": round(self.lr(), 7),
                    **_metrics(self._window, self.args.ttt_steps),
                }
            )
            self._window = Counter()

    # ------------------------------------------------------------------------------ losses

    def _inputs(self, batch: list[Sample]) -> dict[str, torch.Tensor]:
        """Head position t: token t + 1 with the feature of t; targets: feature and distribution of t + 1."""
        dev, eagle3 = self.head.device, self.head.config.arch == "eagle3"
        lengths = [min(len(s.tokens), self.args.max_seq_len) for s in batch]
        B, T = len(batch), max(lengths) - 1
        ids = torch.zeros(B, T, dtype=torch.int64)
        feats = torch.zeros(B, T, self.head.config.feature_dim, device=dev)
        target = torch.zeros(B, T, self.head.config.layer.hidden_size, device=dev)
        mask = torch.zeros(B, T, dtype=torch.bool)
        for b, (s, n) in enumerate(zip(batch, lengths, strict=True)):
            ids[b, : n - 1] = s.tokens[1:n]
            feats[b, : n - 1] = (s.aux if eagle3 else s.hidden)[: n - 1].float()
            target[b, : n - 1] = s.hidden[1:n].float()
            mask[b, max(s.prompt_len - 2, 0) : n - 1] = True  # positions that predict response tokens
        return {"ids": ids.to(dev), "feats": feats, "target": target, "mask": mask.to(dev)}

    def _losses(self, batch: list[Sample], noise: float) -> dict[str, torch.Tensor]:
        head, x = self.head, self._inputs(batch)
        eagle3, evaluating = head.config.arch == "eagle3", not torch.is_grad_enabled()
        feats, result = x["feats"], {}
        if noise:
            rms = feats.pow(2).mean(-1, keepdim=True).sqrt()
            feats = feats + (torch.rand_like(feats) - 0.5) * 2 * noise * rms
        with torch.no_grad():
            hidden, lm_head = x["target"].to(self.engine.dtype), self.engine.model.lm_head
            if eagle3:
                target_logp = restricted_log_probs(hidden, lm_head.weight, head.draft_to_target)
            else:
                target_logp = torch.log_softmax(lm_head(hidden).float(), -1)
            target_p = target_logp.exp()
            target_neg_entropy = (target_p * target_logp).sum(-1)
            target_top1 = target_logp.argmax(-1)
            if evaluating:  # p's mass on the draft vocabulary: the rest is lost to every draft
                mass = inside_mass(hidden, lm_head.weight, head.draft_to_target) if eagle3 else None
                full_p = target_p * mass[..., None] if eagle3 else target_p
                greedy_top1 = target_argmax(hidden, lm_head.weight) if eagle3 else target_top1
        outputs = unroll(head, x["ids"], feats, self.args.ttt_steps)
        all_logits = [head.logits(out) for out in outputs]
        if evaluating:  # the k = 4 chain on this text, on the target's full vocabulary
            # what a draft sampled from q is accepted with at T = 1: sum min(p, q) on the full vocabulary
            t1_overlaps = [overlap(full_p, lg.float()) for lg in all_logits]
            to_target = head.draft_to_target if eagle3 else None
            accept = chain_acceptance(batch, all_logits, t1_overlaps, greedy_top1, to_target)
            drafted = drafted_anchors(x["mask"])
            first = drafted & (x["mask"].cumsum(1) <= FIRST_TOKENS)
            for prefix, anchors in zip(CHAIN_PREFIXES, (drafted, first), strict=True):
                result |= {f"{prefix}{k}": v for k, v in chain_sums(accept, anchors).items()}
        total = 0.0
        for j, (out, logits) in enumerate(zip(outputs, all_logits, strict=True)):
            m = step_mask(x["mask"], j).float()
            denom = m.sum().clamp_min(1.0)
            kl = forward_kl(target_p, target_neg_entropy, logits)
            loss = ((kl * m).sum() / denom) * (1.0 if eagle3 else EAGLE1_TOKEN_LOSS_WEIGHT)
            if not eagle3:
                feature = F.smooth_l1_loss(out.float(), x["target"], reduction="none").mean(-1)
                loss = loss + FEATURE_LOSS_WEIGHT * (feature * m).sum() / denom
            if self.args.tv_weight or evaluating:  # the loss needs it, or an evaluation
                accept = (overlap(target_p, logits) * m).sum() / denom
                loss = loss + self.args.tv_weight * (1.0 - accept)
                result[f"overlap_{j + 1}"] = accept.detach()
            if evaluating:
                result[f"accept_t1_{j + 1}"] = (t1_overlaps[j] * m).sum() / denom
                if j == 0 and eagle3:
                    result["inside_mass"] = (mass * m).sum() / denom
            agree = ((logits.argmax(-1) == target_top1).float() * m).sum() / denom
            result |= {f"loss_{j + 1}": loss.detach(), f"top1_{j + 1}": agree.detach()}
            total = total + self.args.ttt_decay**j * loss
        result["loss"], result["positions"] = total, x["mask"].sum()
        return result

    # ------------------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def evaluate(self, held: list[Conversation]) -> dict:
        """Held-out metrics over all held-out conversations, under "per_source" for each source, and under
        "per_answer" for greedy and for sampled responses apart: a T = 0 run drafts on greedy text, a T = 1
        run on sampled text, so each proxy reads true on its own kind (its metrics computed on both)."""
        groups: dict[tuple[str, str], list[Conversation]] = defaultdict(list)
        for c in held:
            groups[c.source, answer_kind(c.temperature)].append(c)
        sums = {key: self._metric_sums(group) for key, group in sorted(groups.items())}
        total: Counter = Counter()
        per: dict[str, dict[str, Counter]] = {"per_source": defaultdict(Counter),
                                               "per_answer": defaultdict(Counter)}
        for (source, kind), part in sums.items():
            for counter in (total, per["per_source"][source], per["per_answer"][kind]):
                counter.update(part)  # update() keeps zero sums, unlike +
        steps = self.args.ttt_steps
        breakdowns = {k: {n: _metrics(p, steps) for n, p in v.items()} for k, v in per.items()}
        return {**_metrics(total, steps), **breakdowns}

    def _metric_sums(self, data: list[Conversation]) -> Counter:
        sums: Counter = Counter()
        for index in self._batches(data, epoch=None):
            samples = record_features(self.engine, [data[i] for i in index])
            with torch_ops(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.cuda):
                r = self._losses(samples, noise=0.0)
            n = float(r.pop("positions"))
            r.pop("loss")
            sums["n"] += n
            for k, v in r.items():
                sums[k] += float(v) if k.startswith(CHAIN_PREFIXES) else float(v) * n  # those: sums already
        return sums


def forward_kl(
    target_p: torch.Tensor, target_neg_entropy: torch.Tensor, logits: torch.Tensor
) -> torch.Tensor:
    """KL(p || softmax(logits)) per row, as sum p log p - p . logits + logsumexp(logits) (p sums to 1):
    log q is never materialised, which saves a full [positions, vocabulary] pass forward and backward."""
    return target_neg_entropy - (target_p * logits).sum(-1) + torch.logsumexp(logits, -1)


def overlap(target_p: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """sum min(p, q) per row, q = softmax(logits): the chance that a draft sampled from q is accepted
    (T = 1), i.e. 1 - the total variation distance; the --tv-weight term raises it directly."""
    return torch.minimum(target_p, torch.softmax(logits, -1)).sum(-1)


@torch.no_grad()
def chain_acceptance(
    batch: list[Sample],
    logits: list[torch.Tensor],
    t1_overlaps: list[torch.Tensor],
    target_top1: torch.Tensor,
    to_target: torch.Tensor | None,
) -> torch.Tensor:
    """[PROXY_K, B, T] per anchor (chain_visits.anchor_acceptance): on greedy answers whether step j's draft
    (its argmax, mapped by to_target when top1 is on the target's vocabulary) is the target's token, on
    sampled answers its chance of acceptance, t1_overlaps[j] (sum min(p, q))."""
    sampled = torch.tensor([s.temperature > 0 for s in batch], device=target_top1.device)[:, None]
    per_step = []
    for lg, t1 in zip(logits[:PROXY_K], t1_overlaps, strict=False):
        draft = lg.argmax(-1) if to_target is None else to_target[lg.argmax(-1)]
        per_step.append(torch.where(sampled, t1, (draft == target_top1).float()))
    return anchor_acceptance(per_step, PROXY_K)


def answer_kind(temperature: float) -> str:
    """"greedy", "sampled", or "unrecorded" (data distilled before answers kept their temperature)."""
    if math.isnan(temperature):
        return "unrecorded"
    return "sampled" if temperature > 0 else "greedy"


def chain_length(rates: list[float]) -> float:
    """Expected tokens a round of a draft chain yields, 1 + a1 + a1 a2 + ..., for each draft step's rate of
    acceptance given the earlier drafts were accepted (steps taken as independent)."""
    total, run = 1.0, 1.0
    for rate in rates:
        run *= rate
        total += run
    return total


def _metrics(sums: Counter, steps: int) -> dict[str, float]:
    """Position-weighted losses, top-1 agreements and (evaluations) overlaps per draft step, and the
    acceptance-length proxies 1 + a1 + a1 a2 + ... (k = 4 chain; a_j is step j's top-1 agreement, or for
    the T = 1 proxy its acceptance on the full vocabulary, accept_t1_j, given the earlier drafts were
    accepted). overlap_j is against p renormalised on the draft vocabulary, as the loss sees it. Evaluations
    also replay the k = 4 chain over the text (chain_visits): chain_length_k4 and chain_per_position, on
    greedy answers what T = 0 drafting yields on them, on sampled ones the expected yield at T = 1."""
    metrics = {k: round(v / max(sums["n"], 1), 4) for k, v in sums.items()
               if k != "n" and not k.startswith(CHAIN_PREFIXES)}
    for prefix, suffix in zip(CHAIN_PREFIXES, ("", f"_first{FIRST_TOKENS}"), strict=True):
        chain = {k.removeprefix(prefix): v for k, v in sums.items() if k.startswith(prefix)}
        if chain:
            replay = chain_metrics(chain)
            metrics[f"chain_length_k4{suffix}"] = replay["mean_acceptance_length"]
            metrics[f"chain_per_position{suffix}"] = replay["acceptance_per_position"]
    proxies = (("top1", "acceptance_length_proxy_k4"), ("accept_t1", "acceptance_length_proxy_k4_t1"))
    for rate, name in proxies:
        if f"{rate}_1" in metrics:
            rates = [metrics[f"{rate}_{min(j, steps)}"] for j in range(1, PROXY_K + 1)]
            metrics[name] = round(chain_length(rates), 3)
    metrics["positions"] = int(sums["n"])
    return metrics
