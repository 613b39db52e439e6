"""When to retry a failed request, and how long to wait first."""

from __future__ import annotations

import random
from dataclasses import dataclass

from keyqueue.errors import ConfigError


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Exponential backoff with jitter, capped, for at most ``max_attempts`` attempts in all."""

    max_attempts: int = 5
    base_delay: float = 0.5
    factor: float = 2.0
    max_delay: float = 60.0
    jitter: float = 0.2
    """Fraction of each delay drawn at random (+/-), so retries of many keys do not align."""

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigError(f"max_attempts must be at least 1, got {self.max_attempts}")
        if self.base_delay < 0 or self.max_delay < 0 or self.factor < 1 or not 0 <= self.jitter <= 1:
            raise ConfigError("retry delays must be >= 0, factor >= 1 and jitter within 0..1")

    def exhausted(self, attempt: int) -> bool:
        """True once ``attempt`` (1-based, the one that just failed) was the last allowed."""
        return attempt >= self.max_attempts

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
        raw = min(self.max_delay, self.base_delay * self.factor ** (attempt - 1))
        spread = raw * self.jitter
        return max(0.0, raw + (rng or random).uniform(-spread, spread))
