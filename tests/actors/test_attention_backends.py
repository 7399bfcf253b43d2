"""The attention-backend seam (`actors.attention`): every backend against each request
attended alone, and the choice of backend from the config, device and dtype."""

from __future__ import annotations

import pytest
import torch

from actors import EngineConfig
from actors.attention import (
    HybridBackend,
    available_backends,
    make_backend,
    resolve_backend,
)
from actors.attention.kernel import KernelDecodeBackend
from actors.attention.sdpa import SdpaDecodeBackend, SdpaPrefillBackend
from actors.attention.varlen import VarlenBackend
from actors.config import ATTENTION_BACKENDS
from tests.actors.attention_step import attend, make_step, reference, reference_varlen

NAMED = [name for name in ATTENTION_BACKENDS if name != "auto"]


@pytest.mark.parametrize("name", NAMED)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(6, 2, 64), (3, 3, 16), (4, 1, 8)])
def test_every_backend_matches_each_request_alone(name, heads, kv_heads, dim, monkeypatch):
    """Decodes, a cached extend and a fresh prompt in one step, through `paged_attention`."""
    step = make_step(heads, kv_heads, dim, seed=heads + dim)
    if name in available_backends("cpu", torch.float32):
        out = attend(lambda caches: make_backend(name, caches), step)
    elif name == "varlen":  # CUDA only: check its inputs with a plain-torch stand-in
        from torch.nn.attention import varlen

        monkeypatch.setattr(varlen, "varlen_attn", reference_varlen)
        out = attend(VarlenBackend, step)
    else:
        pytest.skip(f"{name} cannot run on this machine")
    torch.testing.assert_close(out, reference(step))


# Windows cutting into every request's keys (8), into the long ones only (20), and a window
# every request is within (64: as without one); softcaps below and near the scores' spread.
LAYERS = [
    dict(sliding_window=8),
    dict(sliding_window=20),
    dict(sliding_window=64),
    dict(softcap=1.5),
    dict(sliding_window=8, softcap=2.0),
]


@pytest.mark.parametrize("name", NAMED)
@pytest.mark.parametrize("layer", LAYERS, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_every_backend_windows_and_softcaps_as_hugging_face(name, layer, monkeypatch):
    """A layer's sliding window and logit softcap, as transformers passes them, give each
    request's rows Hugging Face's eager attention with them, on every backend."""
    step = make_step(6, 2, 64, seed=5)
    expected = reference(step, layer.get("sliding_window"), layer.get("softcap"))
    if name in available_backends("cpu", torch.float32):
        out = attend(lambda caches: make_backend(name, caches), step, **layer)
    elif name == "varlen":
        from torch.nn.attention import varlen

        monkeypatch.setattr(varlen, "varlen_attn", reference_varlen)
        out = attend(VarlenBackend, step, **layer)
    else:
        pytest.skip(f"{name} cannot run on this machine")
    torch.testing.assert_close(out, expected)
    if layer.get("sliding_window") != 64:  # the test can fail: the plain answer differs
        assert not torch.allclose(out, reference(step), atol=1e-3)


def test_sdpa_per_request_alone_attends_a_whole_step() -> None:
    """The prefill backend takes decodes too (a segment of one row)."""
    step = make_step()
    torch.testing.assert_close(attend(SdpaPrefillBackend, step), reference(step))


@pytest.mark.parametrize("name", ["sdpa", "cpu_kernel"])
@pytest.mark.parametrize(
    "layer", [{}, dict(sliding_window=8, softcap=2.0)], ids=["plain", "capped"]
)
def test_backend_runs_in_bfloat16(name, layer) -> None:
    step = make_step()
    out = attend(lambda caches: make_backend(name, caches), step, dtype=torch.bfloat16, **layer)
    expected = reference(step, layer.get("sliding_window"), layer.get("softcap"))
    torch.testing.assert_close(out, expected, atol=3e-2, rtol=3e-2)


def test_auto_picks_from_device_and_dtype() -> None:
    assert resolve_backend("auto", "cpu", torch.float32) == "cpu_kernel"  # a compiler here
    assert resolve_backend("auto", "cpu", torch.bfloat16) == "cpu_kernel"
    assert resolve_backend("auto", "cpu", torch.float16) == "sdpa"
    assert resolve_backend("auto", "cuda", torch.bfloat16) == "varlen"
    assert resolve_backend("auto", "cuda", torch.float32) == "sdpa"  # flash has no fp32
    assert available_backends("cpu", torch.float32) == ["cpu_kernel", "sdpa"]
    assert available_backends("cuda", torch.float16) == ["sdpa", "varlen"]


def test_backends_are_built_from_their_parts() -> None:
    caches = [(torch.zeros(4, 16, 2, 8), torch.zeros(4, 16, 2, 8))]
    kernel = make_backend("cpu_kernel", caches)
    sdpa = make_backend("sdpa", caches)
    assert isinstance(kernel, HybridBackend) and isinstance(sdpa, HybridBackend)
    assert isinstance(kernel.decode, KernelDecodeBackend)
    assert isinstance(sdpa.decode, SdpaDecodeBackend)
    assert isinstance(sdpa.prefill, SdpaPrefillBackend)  # cpu_kernel's: test_gemm_prefill
    auto = make_backend("auto", caches)
    assert isinstance(auto, HybridBackend) and isinstance(auto.decode, KernelDecodeBackend)


@pytest.mark.parametrize(
    ("name", "device", "dtype", "message"),
    [
        ("varlen", "cpu", torch.float32, "'varlen' needs CUDA in bfloat16 or float16"),
        ("varlen", "cuda", torch.float32, "runs on cuda in float32"),
        ("cpu_kernel", "cpu", torch.float16, "'cpu_kernel' needs float32 or bfloat16 on CPU"),
        ("cpu_kernel", "cuda", torch.float32, "'cpu_kernel' needs float32 or bfloat16 on CPU"),
        ("flash", "cpu", torch.float32, "attention_backend must be one of"),
    ],
)
def test_a_backend_that_cannot_run_is_refused(name, device, dtype, message) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_backend(name, device, dtype)


def test_config_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"attention_backend must be one of .*'sdpa'"):
        EngineConfig(dtype="float32", attention_backend="flash")  # type: ignore[arg-type]


def test_the_engine_refuses_varlen_on_cpu(make_engine) -> None:
    with pytest.raises(ValueError, match="'varlen' needs CUDA"):
        make_engine(num_kv_blocks=8, attention_backend="varlen")


def test_the_kernel_backend_checks_the_caches_once_when_built() -> None:
    caches = [(torch.zeros(4, 16, 2, 8, dtype=torch.bfloat16),) * 2]
    kernel = make_backend("cpu_kernel", [(torch.zeros(4, 16, 2, 8),) * 2])
    assert isinstance(kernel, HybridBackend)
    with pytest.raises(ValueError, match="k_cache must be a contiguous CPU torch.float32"):
        KernelDecodeBackend(caches, kernel.decode.kernel)


def test_a_read_only_array_becomes_a_tensor_without_a_warning() -> None:
    """tp/pp workers get their step plan's arrays read-only from Ray's object store: torch
    warned "The given NumPy array is not writable" into the workers' logs for every step."""
    import warnings

    import numpy as np

    from actors.attention.base import device_tensor

    array = np.arange(6, dtype=np.int64)
    array.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tensor = device_tensor(array, torch.device("cpu"))
    assert tensor.tolist() == list(range(6))
