"""The built-in task: two-digit addition on a tiny vocabulary, with a reward a program can check.

A prompt is ``BOS a + b =`` with digits a, b in [0, 9]; the answer is the two digits of a + b
(tens first, 0-padded) then EOS. The reward gives partial credit per correct position, so a policy
starting from random weights gets a signal from its first step.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

PAD, EOS, BOS, PLUS, EQ = 0, 1, 2, 3, 4
DIGIT0 = 5
VOCAB_SIZE = DIGIT0 + 10
ANSWER_LEN = 3  # tens, units, EOS


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def prompt(self) -> list[int]:
        return [BOS, DIGIT0 + self.a, PLUS, DIGIT0 + self.b, EQ]

    @property
    def answer(self) -> list[int]:
        total = self.a + self.b
        return [DIGIT0 + total // 10, DIGIT0 + total % 10, EOS]

    def reward(self, completion: list[int]) -> float:
        """Fraction of the answer's positions the completion gets right (0.0 to 1.0)."""
        return sum(1.0 for got, want in zip(completion, self.answer) if got == want) / ANSWER_LEN


def sample_problems(n: int, rng: random.Random) -> list[Problem]:
    return [Problem(rng.randrange(10), rng.randrange(10)) for _ in range(n)]
