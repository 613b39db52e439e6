"""First-party optional plugins of keyqueue, each installed through an extra (``keyqueue[spark]``, ...)."""
