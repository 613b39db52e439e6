"""``python -m keyqueue``: the ``keyqueue`` command line."""

from keyqueue.cli import main

main()
