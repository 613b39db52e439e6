"""The Rebaser demo: ``python -m examples.rebaser`` (``make demo``)."""
