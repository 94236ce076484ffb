"""The policy's weights on their way to the engines (raytrain_ext.rollout.weights_wire):
every dtype arrives bit-identical, NumPy's own as arrays of that dtype, the others as
integer arrays of the same width; read in place from the object store (read-only), what
arrives loads into an engine's model exactly."""

import pickle

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


def through_the_object_store(wire):
    """``wire`` pickled as Ray puts it (protocol 5, arrays out of band) and read back as Ray
    reads it: every array over the stored bytes, read-only."""
    buffers = []
    data = pickle.dumps(wire, protocol=5, buffer_callback=buffers.append)
    stored = [bytes(b.raw()) for b in buffers]  # the object store's copy
    return pickle.loads(data, buffers=[memoryview(b) for b in stored])


def test_weights_read_in_place_from_the_store_load_into_a_model_exactly(recwarn):
    model = torch.nn.Linear(3, 2).to(torch.bfloat16)
    state = {k: v.detach().clone() + 1 for k, v in model.state_dict().items()}
    arrived = through_the_object_store(to_wire(state))
    assert all(not t.array.flags.writeable for t in arrived.values())  # read in place
    with torch.no_grad():
        for name, tensor in from_wire(arrived).items():
            model.get_parameter(name).copy_(tensor)
    assert all(torch.equal(model.state_dict()[k], state[k]) for k in state)
    assert not [w for w in recwarn if "not writable" in str(w.message)]


def test_a_scalar_arrives_as_a_scalar():
    back = from_wire(through_the_object_store(to_wire({"s": torch.tensor(2.5)})))
    assert back["s"].shape == () and back["s"].item() == 2.5
