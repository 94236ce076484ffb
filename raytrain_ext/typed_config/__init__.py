"""The building blocks of a typed config section, shared by every package that owns one.

A package that reads a config section declares it (``checkpoint/config.py``,
``parallel/config.py``, ...) with these: :mod:`.choice` (the closed sets of values),
:mod:`.fields` (ranges declared on a field) and :mod:`.serialize` (a resolved config as
plain values, YAML and a digest).  ``config/`` composes the sections into the run's
config and loads it.  This package imports nothing else of raytrain_ext, so every
section's owner can import it without an import running back up into ``config/``.
"""
