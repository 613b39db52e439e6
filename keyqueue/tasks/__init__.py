"""The task API below the app: declaring tasks, binding and encoding their arguments, running them.

- ``task``: ``Task`` / ``BatchTask``, ``TaskSpec``, ``TaskRequest``, ``Receipt``: what
  ``@app.task`` returns and what ``enqueue`` / ``call`` / ``delay`` build; ``Dispatcher``, what a
  task sends them through (``keyqueue.App`` implements it).
- ``decorators``: the decorators ``App.task`` and ``keyqueue.task`` return.
- ``arguments``: argument binding, key templates, versioned argument messages, results.
- ``argument_types``: checking arguments against simple annotations when they are enqueued.
- ``invoke``: calling a task function (async or in a thread) with its context.
- ``context``: ``Context``, what a task function receives.

May import ``core.processor``, ``core.retry``, ``jetstream.subjects``, ``wire`` and ``errors``. It never
imports ``keyqueue.app``, not even for type hints: a task reaches its app only through the
``Dispatcher`` it is bound to (``tests/unit/test_layers.py`` checks it).
"""
