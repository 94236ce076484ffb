"""Operator tools, apart from what runs a training job: ``raytrain-ext doctor`` (is this
cluster fit to train: GPUs, NCCL, network, collectives), ``plan`` (memory arithmetic and a
layout recommendation, pure) and ``report`` (a finished run's records, read back).

Only the CLI imports them; nothing on a training job's path does.
"""
