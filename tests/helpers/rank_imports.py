"""What the multi-process tier's ranks import lazily, imported once by its fork server.

Measured with ``PYTHONPROFILEIMPORTTIME`` over the tier, each a rank's own import before:
DDP's first construction imports ``torch._dynamo`` (1.0-1.4 s a rank); a ZeRO rank
``deepspeed`` and, in ``deepspeed.initialize``, its Muon optimizer's module (1.5-2 s, most of
it ``torch._inductor``); an HF model ``transformers.modeling_utils`` (0.8 s); a PP rank
``torch.distributed.pipelining`` (0.2 s); a DTensor layout ``torch.distributed.tensor.debug``
(20 ms, in 250 ranks); an S3 checkpoint ``boto3`` (70 ms).  The tier took 393 s without them
and 316-328 s with them.

Each is imported apart, and any failure is left to the rank, which imports the module again
and meets its real error: the fork server ends on an error in its preload (it only catches
``ImportError``), and every rank of the session with it.  None of these starts a thread at
import.  DeepSpeed picks and keeps its accelerator when imported, from ``DS_ACCELERATOR``:
``tests/conftest.py`` sets it to ``cpu`` before anything imports it.
"""

import importlib

LAZY_IN_RANKS = (
    "torch._dynamo",
    "torch.distributed.pipelining",
    "torch.distributed.tensor.debug",
    "transformers",
    "transformers.modeling_utils",
    "deepspeed",
    "deepspeed.runtime.zero.muon.muon_optimizer",
    "boto3",
)

for _name in LAZY_IN_RANKS:
    try:
        importlib.import_module(_name)
    except Exception:  # noqa: BLE001, S110 - the rank meets the real error (module doc)
        pass
