"""GPU presets listed in API.md, with vendor dense-bf16 peaks and HBM sizes."""

from __future__ import annotations

import pytest

from cost_models.hardware import GIB, gpu_preset, gpu_preset_names


@pytest.mark.parametrize(
    "name,peak,memory",
    [
        ("A100-40GB", 312, 40),
        ("A100-80GB", 312, 80),
        ("H100-SXM", 989, 80),
        ("H200", 989, 141),
        ("B200", 2250, 180),
    ],
)
def test_api_presets(name, peak, memory):
    assert name in gpu_preset_names()
    gpu = gpu_preset(name)
    assert gpu.name == name
    assert gpu.peak_tflops == peak
    assert gpu.memory_gib == memory
    assert gpu.memory_bytes == memory * 1024**3
    assert GIB == 2**30


def test_unknown_preset_raises_key_error():
    with pytest.raises(KeyError):
        gpu_preset("V100-imaginary")


def test_doc_entry_is_not_a_preset():
    assert all(not name.startswith("_") for name in gpu_preset_names())
