"""Ray Train's function API (``TorchTrainer``, ``report``, ``get_checkpoint``, ...), run by
this project's elastic controller (implemented in ``raytrain_ext.user_loop``): moving a
script over is an import change, ``import ray.train`` -> ``import raytrain_ext.train``.

The package also holds the built-in per-worker training loop and what it needs
(optimizer, schedule, digests); the names below are exported on first use (PEP 562), so
importing the loop's modules imports none of them.
"""

from raytrain_ext.lazy_exports import exporter

_EXPORTS = {
    "TorchTrainer": "raytrain_ext.user_loop.torch_trainer",
    "Result": "raytrain_ext.user_loop.torch_trainer",
    "Checkpoint": "raytrain_ext.user_loop.checkpoint",
    "ScalingConfig": "raytrain_ext.user_loop.ray_train_config",
    "RunConfig": "raytrain_ext.user_loop.ray_train_config",
    "FailureConfig": "raytrain_ext.user_loop.ray_train_config",
    "CheckpointConfig": "raytrain_ext.user_loop.ray_train_config",
    "TrainContext": "raytrain_ext.user_loop.session",
    "report": "raytrain_ext.user_loop.api",
    "get_checkpoint": "raytrain_ext.user_loop.api",
    "get_context": "raytrain_ext.user_loop.api",
    "get_dataset_shard": "raytrain_ext.user_loop.api",
    "register": "raytrain_ext.user_loop.api",
}
__getattr__ = exporter(globals(), _EXPORTS)
__all__ = sorted(_EXPORTS)
