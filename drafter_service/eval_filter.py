"""Keep published evaluation questions (MT-bench, Vicuna-bench) out of training and held-out prompts.

The repository stores no question text, only fingerprints: 40-bit hashes of every 8-word window of each
normalised question (shorter questions: of the whole text). A prompt matches a question when it contains
two of its windows (or its one window), so pasted or lightly wrapped copies are caught too.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

FINGERPRINTS = Path(__file__).with_name("eval_fingerprints.json")
WINDOW = 8


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def _hash(words: list[str]) -> str:
    return hashlib.sha256(" ".join(words).encode()).hexdigest()[:10]


def windows(text: str) -> set[str]:
    """The fingerprints of text: hashes of its 8-word windows (of all its words when fewer)."""
    words = _words(text)
    if len(words) <= WINDOW:
        return {_hash(words)} if words else set()
    return {_hash(words[i : i + WINDOW]) for i in range(len(words) - WINDOW + 1)}


class EvalFilter:
    def __init__(self, questions: list[list[str]]):
        self.questions = [set(q) for q in questions if q]
        self._all = set().union(*self.questions) if self.questions else set()

    @classmethod
    def load(cls, path: str | Path = FINGERPRINTS) -> EvalFilter:
        return cls(json.loads(Path(path).read_text())["questions"])

    def matches(self, text: str) -> bool:
        """True when text contains an evaluation question (see the module's rule)."""
        found = windows(text) & self._all
        return bool(found) and any(len(found & q) >= min(2, len(q)) for q in self.questions)


def build_fingerprints(question_files: list[Path], provenance: str) -> dict:
    """Fingerprints of every turn of every question in FastChat-style question.jsonl files."""
    questions = []
    for path in question_files:
        for line in Path(path).read_text().splitlines():
            if line.strip():
                questions += [sorted(windows(turn)) for turn in json.loads(line)["turns"]]
    return {"window_words": WINDOW, "provenance": provenance, "questions": questions}
