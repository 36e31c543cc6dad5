"""Which kernels an engine runs: EngineConfig.backend "auto" resolved for the device and model."""
import logging

import pytest
import torch

from kernels.cpu import library
from replica.engine import resolve_backend

CPU = torch.device("cpu")
needs_cpu_kernels = pytest.mark.skipif(not library.available(), reason="no C++ compiler to build the CPU kernels")


def test_explicit_backends_are_kept():
    for backend in ("torch", "cpu", "triton"):
        assert resolve_backend(backend, CPU, head_dim=64) == backend


def test_auto_picks_triton_on_cuda():
    assert resolve_backend("auto", torch.device("cuda"), head_dim=64) == "triton"


@needs_cpu_kernels
def test_auto_picks_the_cpu_kernels_on_cpu():
    assert resolve_backend("auto", CPU, head_dim=64) == "cpu"


@needs_cpu_kernels
def test_auto_falls_back_to_torch_for_a_head_dim_the_cpu_kernels_lack(caplog):
    with caplog.at_level(logging.WARNING):
        assert resolve_backend("auto", CPU, head_dim=48) == "torch"
    assert "head_dim in" in caplog.text


def test_auto_falls_back_to_torch_without_a_compiler(monkeypatch, caplog):
    def no_compiler():
        raise library.BuildError("no C++ compiler found")

    monkeypatch.setattr(library, "load", no_compiler)
    with caplog.at_level(logging.WARNING):
        assert resolve_backend("auto", CPU, head_dim=64) == "torch"
    assert "no C++ compiler found" in caplog.text


def test_unknown_backend_is_rejected_by_the_config():
    from replica.engine import EngineConfig
    with pytest.raises(ValueError):
        EngineConfig(backend="cuda")
