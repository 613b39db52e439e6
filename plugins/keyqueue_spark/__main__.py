"""``python -m keyqueue_spark report QUEUE`` / ``backfill INPUT ...``."""

from .cli import main

if __name__ == "__main__":
    main(prog_name="python -m keyqueue_spark")
