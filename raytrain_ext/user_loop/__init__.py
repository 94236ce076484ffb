"""The user's own training loop (Ray Train's function API) on this project's controller.

``raytrain_ext.train`` is the public surface (``TorchTrainer``, ``report``,
``get_checkpoint``, ...); this package implements it: ``torch_trainer`` on the driver
(Ray Train's config objects -> a run of the elastic controller), ``function_loop`` on
each rank (the user's function in place of the built-in loop), ``session`` (what
``report`` and friends reach from inside it), ``checkpoint`` and ``storage`` (reported
directories, persisted in the background), ``dataset_shard`` (``get_dataset_shard``: each
dataset read once, in a world-size-independent order, resumed where a checkpoint left it).
"""
