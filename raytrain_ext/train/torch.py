"""``raytrain_ext.train.torch``: Ray Train's ``ray.train.torch`` names."""

from raytrain_ext.user_loop.torch_trainer import TorchTrainer
from raytrain_ext.user_loop.torch_utils import get_device, prepare_data_loader, prepare_model

__all__ = ["TorchTrainer", "get_device", "prepare_data_loader", "prepare_model"]
