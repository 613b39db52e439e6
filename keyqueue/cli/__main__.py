"""``python -m keyqueue.cli``: the ``keyqueue`` command line."""

from keyqueue.cli import main

main()
