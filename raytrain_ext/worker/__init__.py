"""Worker group: Ray actors placed as a gang, forming one torch.distributed group."""
