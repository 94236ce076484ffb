"""The controller that runs, watches and (later) resizes the worker group."""
