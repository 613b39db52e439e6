"""Schedule expressions as nats-server reads them (ADR-51 ``Nats-Schedule``), checked here first.

The server accepts ``@at <RFC 3339 time>`` (2.12), ``@every <Go duration>`` of at least one
second and cron expressions with an optional IANA time zone (2.14). Its cron grammar is
robfig/cron's with six fields, ``second minute hour day-of-month month day-of-week``: each field a
comma-separated list of ``*``, ``?``, ``N``, ``N-M``, with an optional ``/step``; month and weekday
names (``jan``, ``mon``); weekdays 0-6 (Sunday is 0; the server refuses 7, which many crontabs
also read as Sunday, so :func:`cron_pattern` writes a 7 as 0); ``@yearly``, ``@annually``,
``@monthly``, ``@weekly``, ``@daily``, ``@midnight`` and ``@hourly``. A five-field expression (the
crontab form, no seconds) is read here as firing at second 0. Anything else the server would refuse
the schedule with an error that names no field, so :func:`cron_pattern` refuses it first, saying
which field is wrong.

:func:`next_cron` and :func:`next_every` compute when a schedule fires next the way the server
does; ``keyqueue schedules`` shows it and ``keyqueue.testing`` fires on it.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass
from typing import Final
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from keyqueue.errors import InvalidSchedule

__all__ = ["PREDEFINED", "CronSpec", "at_pattern", "cron_pattern", "every_pattern", "every_seconds", "next_cron",
           "next_every", "parse_cron", "parse_every", "zone"]

PREDEFINED: Final = {
    "@yearly": "0 0 0 1 1 *", "@annually": "0 0 0 1 1 *", "@monthly": "0 0 0 1 * *", "@weekly": "0 0 0 * * 0",
    "@daily": "0 0 0 * * *", "@midnight": "0 0 0 * * *", "@hourly": "0 0 * * * *",
}
"""The named schedules the server knows, as six-field cron expressions."""

_FIELDS: Final[tuple[tuple[str, int, int, dict[str, int]], ...]] = (
    ("second", 0, 59, {}),
    ("minute", 0, 59, {}),
    ("hour", 0, 23, {}),
    ("day of month", 1, 31, {}),
    ("month", 1, 12, {m: n for n, m in enumerate(
        ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"), start=1)}),
    ("day of week", 0, 6, {d: n for n, d in enumerate(("sun", "mon", "tue", "wed", "thu", "fri", "sat"))}),
)

_YEARS_AHEAD: Final = 5
"""The server gives up on a cron expression that matches nothing within five years."""


@dataclass(frozen=True, slots=True)
class CronSpec:
    """A parsed six-field cron expression: the allowed values of each field."""

    seconds: frozenset[int]
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]
    days_star: bool
    weekdays_star: bool

    def day_matches(self, day: dt.date) -> bool:
        dom = day.day in self.days
        dow = (day.isoweekday() % 7) in self.weekdays
        if self.days_star or self.weekdays_star:
            return dom and dow
        return dom or dow


def zone(name: str) -> ZoneInfo:
    """The IANA time zone ``name`` (``InvalidSchedule`` if unknown)."""
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise InvalidSchedule(f"time zone {name!r} is not an IANA time zone name such as 'Europe/Oslo' or 'UTC'") \
            from None


def _range(expr: str, name: str, low: int, high: int, names: dict[str, int]) -> tuple[set[int], bool]:
    where = f"the {name} field {expr!r}"
    range_step = expr.split("/")
    if len(range_step) > 2:
        raise InvalidSchedule(f"{where} has more than one '/'")
    bounds = range_step[0].split("-")
    star = bounds[0] in ("*", "?")

    def number(text: str) -> int:
        if text.lower() in names:
            return names[text.lower()]
        if not text.isdigit():
            raise InvalidSchedule(f"{where}: {text!r} is not a number{' or a name' if names else ''}")
        return int(text)

    if star:
        if len(bounds) > 1:
            raise InvalidSchedule(f"{where}: '*' takes no range")
        start, end = low, high
    else:
        if len(bounds) > 2:
            raise InvalidSchedule(f"{where} has more than one '-'")
        start = number(bounds[0])
        end = number(bounds[1]) if len(bounds) == 2 else start
    step = 1
    if len(range_step) == 2:
        if not range_step[1].isdigit():
            raise InvalidSchedule(f"{where}: the step {range_step[1]!r} is not a number")
        step = int(range_step[1])
        if len(bounds) == 1:
            end = high  # "N/step" means "N-max/step", as the server reads it
        if step > 1:
            star = False
    if start < low or end > high:
        raise InvalidSchedule(f"{where} is outside {low}-{high}")
    if start > end:
        raise InvalidSchedule(f"{where} starts after it ends")
    if step == 0:
        raise InvalidSchedule(f"{where}: the step must be positive")
    return set(range(start, end + 1, step)), star


def parse_cron(pattern: str) -> CronSpec:
    """A six-field cron expression (or a named one) as the server reads it; ``InvalidSchedule`` if it is not one."""
    fields = PREDEFINED.get(pattern.strip(), pattern).split()
    if len(fields) != 6:
        raise InvalidSchedule(f"cron expression {pattern!r} has {len(fields)} fields; it needs 5 (minute hour "
                              "day month weekday) or 6 (with seconds first), or a name such as @daily")
    values: list[frozenset[int]] = []
    stars: list[bool] = []
    for text, (name, low, high, names) in zip(fields, _FIELDS, strict=True):
        allowed: set[int] = set()
        star = False
        for part in text.split(","):
            if not part:
                raise InvalidSchedule(f"cron expression {pattern!r}: the {name} field {text!r} has an empty part")
            got, part_star = _range(part, name, low, high, names)
            allowed |= got
            star = star or part_star
        values.append(frozenset(allowed))
        stars.append(star)
    seconds, minutes, hours, days, months, weekdays = values
    return CronSpec(seconds, minutes, hours, days, months, weekdays, days_star=stars[3], weekdays_star=stars[5])


def cron_pattern(expression: str) -> str:
    """The ``Nats-Schedule`` value for a cron expression: six fields (seconds first) or a name.

    A five-field crontab expression gets second 0 in front. ``InvalidSchedule`` names what is wrong.
    """
    if not isinstance(expression, str) or not expression.strip():
        raise InvalidSchedule(f"cron must be a non-empty cron expression such as '0 9 * * mon-fri', not {expression!r}")
    text = " ".join(expression.split())
    if text in PREDEFINED:
        return text
    if text.startswith("@"):
        raise InvalidSchedule(f"cron expression {expression!r}: the named schedules are {', '.join(PREDEFINED)}")
    if len(text.split()) == 5:
        text = "0 " + text
    if len(fields := text.split()) == 6:
        text = " ".join([*fields[:5], _sunday_as_zero(fields[5])])
    spec = parse_cron(text)
    if next_cron(spec, ZoneInfo("UTC"), dt.datetime.now(dt.UTC)) is None:
        raise InvalidSchedule(
            f"cron expression {expression!r} never fires (the server looks {_YEARS_AHEAD} years ahead)")
    return text


def _sunday_as_zero(weekdays: str) -> str:
    """A weekday field with crontab's Sunday 7 written as the server's 0 (``5-7`` -> ``0,5,6``); any
    other field as it is."""
    if "*" in weekdays or "?" in weekdays:
        return weekdays
    name, low, _, names = _FIELDS[5]
    try:
        days = set().union(*(_range(part, name, low, 7, names)[0] for part in weekdays.split(",")))
    except InvalidSchedule:
        return weekdays  # parse_cron says what is wrong with it
    if 7 not in days:
        return weekdays
    return ",".join(str(d) for d in sorted({d % 7 for d in days}))


def parse_every(every: float | dt.timedelta) -> float:
    """``every`` in seconds; ``InvalidSchedule`` unless it is at least one second (the server's minimum)."""
    seconds = every.total_seconds() if isinstance(every, dt.timedelta) else every
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not math.isfinite(seconds):
        raise InvalidSchedule(f"every must be a number of seconds or a timedelta, not {every!r}")
    if seconds <= 0:
        raise InvalidSchedule(f"every must be positive, got {every!r}")
    if seconds < 1:
        raise InvalidSchedule(f"every must be at least 1 second (nats-server's shortest interval), got {every!r}")
    return float(seconds)


def every_pattern(seconds: float) -> str:
    """The ``Nats-Schedule`` value for an interval: ``@every 90s`` (``@every 1500ms`` for a fraction)."""
    ms = round(seconds * 1000)
    return f"@every {ms // 1000}s" if ms % 1000 == 0 else f"@every {ms}ms"


def every_seconds(pattern: str) -> float | None:
    """The interval of an ``@every`` value this module wrote (None for anything else)."""
    if not pattern.startswith("@every "):
        return None
    text = pattern[len("@every "):]
    try:
        if text.endswith("ms"):
            return int(text[:-2]) / 1000
        if text.endswith("s"):
            return float(text[:-1])
    except ValueError:
        return None
    return None


def at_pattern(due: dt.datetime) -> str:
    """The ``Nats-Schedule`` value that fires once at ``due`` (an aware datetime), in UTC."""
    return "@at " + due.astimezone(dt.UTC).isoformat().replace("+00:00", "Z")


def next_every(seconds: float, since: dt.datetime, now: dt.datetime) -> dt.datetime:
    """When an ``@every`` schedule stored (or last fired) at ``since`` fires next after ``now``.

    The server fires at ``since`` rounded to the second plus the interval, then every interval
    from the time it fired; a schedule that missed fires (a server that was down) fires once.
    """
    step = dt.timedelta(seconds=seconds)
    first = _round_second(since) + step
    if first > now:
        return first
    periods = math.floor((now - first) / step) + 1
    return first + periods * step


def _round_second(t: dt.datetime) -> dt.datetime:
    base = t.replace(microsecond=0)
    return base + dt.timedelta(seconds=1) if t.microsecond >= 500_000 else base


def next_cron(spec: CronSpec | str, tz: ZoneInfo, after: dt.datetime) -> dt.datetime | None:
    """The first time after ``after`` (strictly) that the cron expression matches in ``tz``, as the
    server computes it; None if nothing matches within five years."""
    if isinstance(spec, str):
        spec = parse_cron(spec)
    t = after.astimezone(tz).replace(microsecond=0, tzinfo=None) + dt.timedelta(seconds=1)
    limit = t.year + _YEARS_AHEAD
    while t.year <= limit:
        if t.month not in spec.months:
            t = (t.replace(day=1, hour=0, minute=0, second=0) + dt.timedelta(days=32)).replace(day=1)
            continue
        if not spec.day_matches(t.date()):
            t = t.replace(hour=0, minute=0, second=0) + dt.timedelta(days=1)
            continue
        if t.hour not in spec.hours:
            t = t.replace(minute=0, second=0) + dt.timedelta(hours=1)
            continue
        if t.minute not in spec.minutes:
            t = t.replace(second=0) + dt.timedelta(minutes=1)
            continue
        if t.second not in spec.seconds:
            t += dt.timedelta(seconds=1)
            continue
        return t.replace(tzinfo=tz)
    return None
