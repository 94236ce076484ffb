"""``data.document_mask``: packed documents never see each other.  Positions restart after
every EOS, the target after an EOS weighs 0, and a Hugging Face model given those positions
computes each document's logits exactly as if it were alone in the window."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raytrain_ext.config import load_config
from raytrain_ext.data.tokens import TokenDataset
from raytrain_ext.errors import InputError
from raytrain_ext.inputs.text_data_check import check_document_mask
from raytrain_ext.models.hf_spec import HF_SPEC
from raytrain_ext.models.spec import batch_logits

pytest.importorskip("transformers")
EOS = 2


def test_positions_restart_after_each_eos_and_the_crossing_target_weighs_zero():
    tokens = np.array([5, 6, EOS, 7, 8, 9, EOS, 4, 4, 3, 3], dtype=np.int64)
    data = TokenDataset(tokens, seq_len=5, document_eos=EOS)
    batch = data.batch(np.array([0, 1]))
    assert batch.inputs.tolist() == [[5, 6, EOS, 7, 8], [9, EOS, 4, 4, 3]]
    assert batch.positions.tolist() == [[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]]
    assert batch.weights.tolist() == [[1, 1, 0, 1, 1], [1, 0, 1, 1, 1]]
    assert data.target_weights(np.array([0, 1])).tolist() == [4.0, 4.0]


def test_an_hf_model_sees_each_packed_document_alone():
    from transformers import AutoModelForCausalLM

    from tests.helpers.hf_models import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config()).eval()
    docs = [torch.randint(3, 500, (n,)) for n in (6, 9, 5)]
    tokens = torch.cat([torch.cat([d, torch.tensor([EOS])]) for d in docs]).numpy()
    data = TokenDataset(tokens, seq_len=len(tokens) - 1, document_eos=EOS)
    with torch.no_grad():
        packed = batch_logits(HF_SPEC, model, data.batch(np.array([0])))[0]
        start = 0
        for doc in docs:
            alone = model(input_ids=torch.cat([doc, torch.tensor([EOS])])[None]).logits[0]
            end = min(start + len(doc) + 1, packed.shape[0])
            torch.testing.assert_close(packed[start:end], alone[: end - start], atol=1e-5, rtol=0)
            start = end
        unmasked = HF_SPEC.logits(model, data.batch(np.array([0])).inputs)[0]
    assert (unmasked[7:] - packed[7:]).abs().max() > 1e-2  # without the mask they differ


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.format=tokens"], "needs data.format=text"),
        (["data.format=text"], "the reference GPT has no per-document attention"),
    ],
)
def test_document_mask_is_refused_where_it_cannot_hold(overrides, message):
    cfg = load_config(None, ["data.document_mask=true", *overrides])
    with pytest.raises(InputError, match=message):
        check_document_mask(cfg)
