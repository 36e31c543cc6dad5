"""Which kernels an engine runs: EngineConfig.backend "auto" resolved for the device and model."""
import logging

import pytest
import torch

from kernels.cpu import library
from replica.engine import resolve_backend

CPU = torch.device("cpu")


def test_explicit_backends_are_kept():
    for backend in ("torch", "cpu", "triton"):
        assert resolve_backend(backend, CPU, head_dim=64) == backend


def test_auto_picks_triton_on_cuda_and_the_cpu_kernels_on_cpu():
    assert resolve_backend("auto", torch.device("cuda"), head_dim=64) == "triton"
    if library.available():
        assert resolve_backend("auto", CPU, head_dim=64) == "cpu"


def test_auto_falls_back_to_torch_when_the_cpu_kernels_cannot_serve(monkeypatch, caplog):
    if library.available():
        with caplog.at_level(logging.WARNING):
            assert resolve_backend("auto", CPU, head_dim=48) == "torch"
        assert "head_dim in" in caplog.text

    def no_compiler():
        raise library.BuildError("no C++ compiler found")

    monkeypatch.setattr(library, "load", no_compiler)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert resolve_backend("auto", CPU, head_dim=64) == "torch"
    assert "no C++ compiler found" in caplog.text


def test_unknown_backend_is_rejected_by_the_config():
    from replica.engine import EngineConfig
    with pytest.raises(ValueError):
        EngineConfig(backend="cuda")
