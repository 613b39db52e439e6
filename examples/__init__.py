"""Runnable examples of keyqueue; run each from the repository root (``python -m examples.demo``)."""
