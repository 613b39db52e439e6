"""The quickstart: an app with three tasks, a producer, and the commands to run them (see README.md)."""
