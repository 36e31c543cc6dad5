"""read_gguf against gguf's own GGUFReader: the same metadata and the same tensor views, for a file holding every
kind of field and several tensor types, and for the default model; and dequantize against gguf.quants."""
import gguf
import numpy as np
import pytest

from replica.executor.checkpoint import default_model_path
from replica.executor.gguf_file import read_gguf
from replica.executor.gguf_loader import dequantize


def assert_read_as_gguf_reads(path: str) -> None:
    ours, theirs = read_gguf(path), gguf.GGUFReader(path)
    assert ours.metadata == {name: field.contents() for name, field in theirs.fields.items()
                             if not name.startswith("GGUF.")}
    assert [(tensor.name, tensor.tensor_type, tensor.data.shape, tensor.data.dtype) for tensor in ours.tensors] == [
        (tensor.name, tensor.tensor_type, tensor.data.shape, tensor.data.dtype) for tensor in theirs.tensors]
    assert all(np.array_equal(mine.data, theirs_.data) for mine, theirs_ in zip(ours.tensors, theirs.tensors))


def test_every_kind_of_field_and_several_tensor_types(tmp_path):
    path = str(tmp_path / "kinds.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint32("a.u32", 7)
    writer.add_int64("a.i64", -3)
    writer.add_float32("a.f32", 0.5)
    writer.add_float64("a.f64", 1e-12)
    writer.add_bool("a.bool", True)
    writer.add_string("a.str", "zürich")
    writer.add_array("a.strs", ["", "tokens", "Ġé"])
    writer.add_array("a.ints", [1, -2, 3])
    writer.add_array("a.floats", [0.25, -1.5])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 4)).astype(np.float16))
    weights = rng.standard_normal((4, 64)).astype(np.float32)
    for qtype in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1):
        writer.add_tensor(qtype.name, gguf.quants.quantize(weights, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_read_as_gguf_reads(path)
    assert read_gguf(path).metadata["a.strs"] == ["", "tokens", "Ġé"]
    for tensor in read_gguf(path).tensors:  # Q4_1 and Q8_0 in torch, the others by gguf
        expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        assert dequantize(tensor).dtype == expected.dtype and np.array_equal(dequantize(tensor), expected)


@pytest.mark.slow
def test_the_default_model_reads_and_dequantizes_as_gguf_does():
    assert_read_as_gguf_reads(str(default_model_path()))
    for tensor in read_gguf(str(default_model_path())).tensors:
        assert np.array_equal(dequantize(tensor), gguf.quants.dequantize(tensor.data, tensor.tensor_type))


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"GGML" + bytes(20))
    with pytest.raises(ValueError, match="is not a GGUF file"):
        read_gguf(str(tmp_path / "x.gguf"))
