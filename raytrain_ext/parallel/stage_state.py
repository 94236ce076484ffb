"""The model state dict of one pipeline stage (or expert shard), for checkpoint checks."""


class StageStateDict(dict):
    """A stage's model state dict that also knows every stage's keys (``whole_model_keys``)."""

    whole_model_keys: set = set()
