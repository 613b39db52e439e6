"""Reference plugins built on keyqueue's public API (each in its own package)."""
