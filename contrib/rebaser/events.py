"""The Rebaser's own lifecycle events in keyqueue's events stream: a DVU run's start and finish.

``dvu_started`` carries the run's ``run_id``; ``dvu_finished`` its ``run_id``, ``run`` (the run's
seconds), ``triggers`` (how many triggers it covered) and ``worker``. Importing this module
registers both names with keyqueue's events contract (``keyqueue.events``), so the processor can
publish them beside keyqueue's own events and ``keyqueue report`` can read its DVU section off them.
"""

from __future__ import annotations

from typing import Final

from keyqueue.events import register_event_names

__all__ = ["DVU_EVENTS", "DVU_FINISHED", "DVU_STARTED"]

DVU_STARTED: Final = "dvu_started"
"""A DVU run started."""

DVU_FINISHED: Final = "dvu_finished"
"""A DVU run's values are stored."""

DVU_EVENTS: Final = (DVU_STARTED, DVU_FINISHED)
"""The event names the Rebaser publishes."""

register_event_names(*DVU_EVENTS)
