"""``python -m plugins.keyqueue_spark report QUEUE`` / ``backfill INPUT ...``."""

from plugins.keyqueue_spark.cli import main

if __name__ == "__main__":
    main(prog_name="python -m plugins.keyqueue_spark")
