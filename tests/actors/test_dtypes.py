"""`dtype="auto"`: bfloat16 on CUDA and on CPUs with native bfloat16, float32 elsewhere;
an explicit bfloat16 on a CPU that emulates it warns; an engine loaded with `auto` runs in
what was chosen; a job resolves `auto` once for all its engines."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from actors import EngineConfig, LLMEngine
from actors.dtypes import CpuInfo, choose_dtype, cpu_info, resolve_dtype
from tests.tiny_models import save_tiny_model

AVX2 = CpuInfo("AMD EPYC (AVX2)", frozenset({"avx2", "fma"}))
BF16 = CpuInfo("Intel Xeon", frozenset({"avx2", "avx512f", "avx512_bf16"}))
AMX = CpuInfo("Intel Xeon (AMX)", frozenset({"avx512f", "amx_bf16", "amx_tile"}))


def test_auto_follows_the_hardware() -> None:
    assert choose_dtype("auto", "cpu", AVX2)[0] == "float32"
    assert choose_dtype("auto", "cpu", BF16) == (
        "bfloat16",
        "auto: the CPU computes bfloat16 natively (avx512_bf16)",
    )
    assert choose_dtype("auto", "cpu", AMX)[0] == "bfloat16"
    assert choose_dtype("auto", "cuda:0", AVX2)[0] == "bfloat16"
    # What is asked for is what runs.
    assert choose_dtype("float32", "cpu", BF16) == ("float32", "asked for")
    assert choose_dtype("bfloat16", "cpu", AVX2) == ("bfloat16", "asked for")
    with pytest.raises(ValueError, match="dtype must be one of"):
        choose_dtype("fp8", "cpu", AVX2)


def test_explicit_bfloat16_warns_only_where_it_is_emulated(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="actors.dtypes"):
        assert resolve_dtype("bfloat16", "cpu", AVX2) == torch.bfloat16
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "0.21x float32" in warnings[0].getMessage()
    assert "AMD EPYC (AVX2)" in warnings[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="actors.dtypes"):
        assert resolve_dtype("bfloat16", "cpu", BF16) == torch.bfloat16
        assert resolve_dtype("auto", "cpu", AVX2) == torch.float32
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "dtype float32 (auto: the CPU has no native bfloat16" in caplog.text


def test_cpu_info_reads_model_and_flags(tmp_path: Path) -> None:
    text = (
        "processor\t: 0\nmodel name\t: AMD EPYC 9B45\nflags\t\t: fpu avx2 avx512_bf16\n\n"
        "processor\t: 1\nmodel name\t: AMD EPYC 9B45\nflags\t\t: fpu avx2 avx512_bf16\n"
    )
    (tmp_path / "cpuinfo").write_text(text)
    info = cpu_info(tmp_path / "cpuinfo")
    assert info.model_name == "AMD EPYC 9B45" and info.native_bf16
    assert info.isa()["avx512_bf16"] and not info.isa()["amx_bf16"]
    assert cpu_info(tmp_path / "missing").flags == frozenset()


def test_engine_config_default_is_auto_and_checked() -> None:
    assert EngineConfig().dtype == "auto"
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineConfig(dtype="half")


def test_an_auto_engine_runs_in_the_dtype_this_machine_gets(tmp_path: Path) -> None:
    model_dir = save_tiny_model(tmp_path / "m")
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=16))
    expected = getattr(torch, choose_dtype("auto", "cpu", cpu_info())[0])
    assert next(engine.model.parameters()).dtype == expected
