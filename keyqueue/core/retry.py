"""When to retry a failed request, and how long to wait first."""

from __future__ import annotations

import random
from dataclasses import dataclass

from keyqueue.errors import ConfigError, Retry


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Exponential backoff with jitter, capped, for at most ``max_attempts`` attempts in all."""

    max_attempts: int = 5
    base_delay: float = 0.5
    factor: float = 2.0
    max_delay: float = 60.0
    jitter: float = 0.2
    """Fraction of each delay drawn at random (+/-), so retries of many keys do not align."""
    retry_on: tuple[type[BaseException], ...] | None = None
    """Only these exceptions (and subclasses) are retried; None: any. ``Retry`` always is."""

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigError(f"max_attempts must be at least 1, got {self.max_attempts}")
        if self.base_delay < 0 or self.max_delay < 0 or self.factor < 1 or not 0 <= self.jitter <= 1:
            raise ConfigError("retry delays must be >= 0, factor >= 1 and jitter within 0..1")

    def exhausted(self, attempt: int) -> bool:
        """True once ``attempt`` (1-based, the one that just failed) was the last allowed."""
        return attempt >= self.max_attempts

    def retries(self, error: BaseException) -> bool:
        """Whether a failure with ``error`` is retried (attempts allowing): ``Retry`` always, others
        when ``retry_on`` is None or lists their class."""
        return self.retry_on is None or isinstance(error, (Retry, *self.retry_on))

    def delay_after(self, attempt: int, error: BaseException, rng: random.Random | None = None) -> float:
        """Seconds to wait after failed attempt ``attempt``: a ``Retry``'s own countdown, else :meth:`delay`."""
        if isinstance(error, Retry) and error.countdown is not None:
            return error.countdown
        return self.delay(attempt, rng)

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
        raw = min(self.max_delay, self.base_delay * self.factor ** (attempt - 1))
        spread = raw * self.jitter
        return max(0.0, raw + (rng or random).uniform(-spread, spread))
