"""The streaming sink: ``writeStream.format("keyqueue")``, each row stored once.

::

    (events.writeStream.format("keyqueue")
       .option("queue", "audit").option("task", "Audit").option("key", "key")
       .option("checkpointLocation", "chk/").start())

Each micro-batch is written as the batch sink writes a DataFrame (:class:`PartitionWriter`: one
connection per task, rows published in order, so a key's rows from one partition are stored and
run in that order), with request ids derived from the query, the micro-batch and the row:

* the job id is the ``jobId`` option, by default ``stream:<query id>`` (Spark's query id, kept in
  the checkpoint, so a restarted query has the same one);
* the row's identity is (micro-batch id, partition, and the batch sink's content identity: the
  encoded body and how many rows of the partition had the same key and body before it); with
  ``idColumn``, that column's value alone (a stable row id then dedupes across micro-batches too).

A retried task, or a micro-batch that Spark runs again after a restart, so publishes the same
ids, and JetStream drops the repeats within the inbox's duplicate window. A row the server
refuses for now (a full per-key backlog, no acknowledgement) fails its task
(:class:`~keyqueue_spark.sink.KeyqueueWriteRefused`), so Spark runs the task, or after a
restart the micro-batch, again. For restarts later than the window, the driver's commit records
the last committed micro-batch of the query in the KV bucket :data:`COMMITS_BUCKET` (key
``query.<query id>``) before Spark records it in the checkpoint, and only once every row of the
micro-batch is stored or counted bad within ``maxErrors``: a task of a micro-batch at or below
it writes nothing (its rows count as ``skipped``). What no id can cover is a micro-batch cut
off mid-way and run again only after the duplicate window has passed: raise the queue's window
(``duplicateWindow`` when the sink creates it) above the longest outage you expect.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from typing import Any, Final

from pyspark.sql import Row
from pyspark.sql.datasource import DataSourceStreamWriter, WriterCommitMessage
from pyspark.sql.types import StructType

from keyqueue.errors import KeyqueueError, WrongLastSequence
from keyqueue.ext import Client, KeyValue

from .rows import RowIdentity
from .sink import (
    PartitionWriter,
    SinkColumns,
    SinkOptions,
    WriteSummary,
    check_errors,
    create_queue_if_missing,
    report_write,
)
from .source import lower_keys
from .streams import connect_to

COMMITS_BUCKET: Final = "keyqueue_spark_commits"
"""The KV bucket where the streaming sink records each query's last committed micro-batch."""

QUERY_ID_PROPERTY: Final = "sql.streaming.queryId"
"""The Spark local property a streaming query's tasks carry its id in."""

BATCH_ID_PROPERTY: Final = "streaming.sql.batchId"
"""The Spark local property a micro-batch's tasks carry its id in."""


def commit_key(query_id: str) -> str:
    return f"query.{query_id}"


async def last_committed(nc: Client, query_id: str) -> int | None:
    """The last micro-batch of ``query_id`` this sink committed, or None."""
    bucket = KeyValue(nc, COMMITS_BUCKET)
    await bucket.ensure()
    entry = await bucket.get(commit_key(query_id))
    return int(entry.value) if entry is not None else None


async def record_commit(nc: Client, query_id: str, batch_id: int) -> None:
    """Record ``batch_id`` as committed for ``query_id``; never moves the record backwards."""
    bucket = KeyValue(nc, COMMITS_BUCKET)
    await bucket.ensure()
    key = commit_key(query_id)
    while True:
        entry = await bucket.get(key)
        if entry is not None and int(entry.value) >= batch_id:
            return
        try:
            await bucket.put(key, str(batch_id).encode(), expected_revision=entry.revision if entry else 0)
            return
        except WrongLastSequence:
            continue  # another commit of the query got there first: read it again


def stream_task() -> tuple[str, int]:
    """The query id and micro-batch id of the running Spark task."""
    from pyspark import TaskContext

    context = TaskContext.get()
    query_id = context.getLocalProperty(QUERY_ID_PROPERTY) if context is not None else None
    batch_id = context.getLocalProperty(BATCH_ID_PROPERTY) if context is not None else None
    if not query_id or batch_id is None:
        raise KeyqueueError("the keyqueue stream writer runs in a streaming query's tasks only: use "
                            'df.write.format("keyqueue") for a DataFrame')
    return query_id, int(batch_id)


class KeyqueueStreamWriter(DataSourceStreamWriter):
    """Writes each micro-batch's rows as requests, once; the commit records the micro-batch."""

    def __init__(self, options: Mapping[str, str], schema: StructType, overwrite: bool) -> None:
        if overwrite:
            raise ValueError('the keyqueue sink only appends requests: use .outputMode("append")')
        self.options = SinkOptions.from_options(options)
        self.job_id_given = bool(lower_keys(options).get("jobid"))
        self.columns = SinkColumns.plan(self.options, schema)
        self.options.backlog_limit()
        create_queue_if_missing(self.options)

    def write(self, iterator: Iterator[Row]) -> WriteSummary:
        query_id, batch_id = stream_task()
        summary = WriteSummary(query_id=query_id)
        committed = asyncio.run(self._last_committed(query_id))
        if committed is not None and batch_id <= committed:
            summary.partitions = 1
            summary.skipped = sum(1 for _ in iterator)
            summary.rows = summary.skipped
            return summary
        job_id = self.options.job_id if self.job_id_given else f"stream:{query_id}"
        writer: PartitionWriter
        identity = RowIdentity()
        prefix = f"batch\x00{batch_id}\x00".encode()

        def identify(key: str, body: bytes, id_value: Any) -> bytes:
            if self.columns.id_index is not None:
                return RowIdentity.by_column(id_value)
            return prefix + str(writer.partition).encode() + b"\x00" + identity.by_content(key, body)

        writer = PartitionWriter(self.options, self.columns, job_id, identify, summary)
        return writer.run(iterator)

    async def _last_committed(self, query_id: str) -> int | None:
        nc = await connect_to(self.options.url)
        try:
            return await last_committed(nc, query_id)
        finally:
            await nc.close()

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        # Spark calls this only once every task succeeded, so each row is stored or counted bad. More
        # bad rows than maxErrors fail the query before the record: a restart runs the micro-batch again.
        total = WriteSummary.total(messages)
        report_write(total, self.options, f"stream write committed micro-batch {batchId}", aborted=False,
                     batch_id=batchId)
        check_errors(total, self.options)
        if total.query_id is not None:
            asyncio.run(self._record(total.query_id, batchId))

    async def _record(self, query_id: str, batch_id: int) -> None:
        nc = await connect_to(self.options.url)
        try:
            await record_commit(nc, query_id, batch_id)
        finally:
            await nc.close()

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        report_write(WriteSummary.total(messages), self.options, f"stream write aborted micro-batch {batchId}",
                     aborted=True, batch_id=batchId)
