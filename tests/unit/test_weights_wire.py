"""The policy's weights on their way to the engines (raytrain_ext.rollout.weights_wire):
every dtype arrives bit-identical, NumPy's own as arrays of that dtype, the others as
integer arrays of the same width; what arrives loads into an engine's model exactly."""

import numpy as np
import pytest
import torch

from raytrain_ext.rollout.weights_wire import from_wire, to_wire


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int64]
)
def test_every_dtype_arrives_to_the_bit(dtype):
    torch.manual_seed(0)
    source = (torch.randn(5, 3) * 4).to(dtype)
    wire = to_wire({"w": source, "w_t": source.t()})  # a transposed view is sent in order
    back = from_wire(wire)
    assert wire["w"].dtype == str(dtype).removeprefix("torch.")
    assert back["w"].dtype == dtype and back["w_t"].shape == (3, 5)
    assert torch.equal(bits(back["w"]), bits(source))
    assert torch.equal(bits(back["w_t"]), bits(source.t()))


def test_a_dtype_numpy_lacks_travels_as_an_integer_array_of_its_width():
    wire = to_wire({"b": torch.ones(4, dtype=torch.bfloat16)})
    assert wire["b"].array.dtype == np.int16
    assert wire["b"].array.tolist() == [0x3F80] * 4  # bfloat16's 1.0


def test_read_only_arrays_load_into_a_model_without_a_warning(recwarn):
    model = torch.nn.Linear(3, 2)
    state = {k: v.detach().clone() + 1 for k, v in model.state_dict().items()}
    wire = to_wire(state)
    for t in wire.values():
        t.array.setflags(write=False)  # as Ray's object store hands them out
    with torch.no_grad():
        for name, tensor in from_wire(wire).items():
            model.get_parameter(name).copy_(tensor)
    assert all(torch.equal(model.state_dict()[k], state[k]) for k in state)
    assert not [w for w in recwarn if "not writable" in str(w.message)]
