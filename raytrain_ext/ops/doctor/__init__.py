"""``raytrain-ext doctor``: diagnose the Ray cluster a job would train on (versions, GPUs,
NCCL settings and logs, network, collective bandwidth on a gang of worker actors)."""
