"""The weight delta format (engine/weight_delta.py): bit-exact rebuilds, and refusals that change nothing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollq.engine import weight_delta as wd


def _weights(seed: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 16, generator=g).to(dtype),
        "layer.0.weight": torch.randn(16, 16, generator=g).to(dtype),
        "norm.weight": torch.ones(16, dtype=dtype),
    }


def _stepped(weights: dict[str, torch.Tensor], lr: float, seed: int) -> dict[str, torch.Tensor]:
    """An Adam-sized step (lr * sign) on the master weights, cast back: what a trainer publishes."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in weights.items():
        master = t.float() - lr * torch.sign(torch.randn(t.shape, generator=g))
        out[name] = master.to(t.dtype) if name != "norm.weight" else t.clone()  # one tensor keeps every bit
    return out


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    lr=st.sampled_from([1e-6, 1e-4, 1e-2]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
)
def test_a_delta_rebuilds_the_new_weights_bit_for_bit(seed: int, lr: float, dtype: torch.dtype) -> None:
    base = _weights(seed, dtype)
    new = _stepped(base, lr, seed + 1)
    delta = wd.encode(base, new, base_version="3", version="4")
    rebuilt = {**base, **wd.apply(base, delta)}
    for name in new:
        assert torch.equal(rebuilt[name].view(torch.uint8), new[name].view(torch.uint8)), name
    unchanged = {t.name for t in delta.manifest.tensors if t.encoding == "unchanged"}
    assert "norm.weight" in unchanged
    assert set(wd.apply(base, delta)) == set(new) - unchanged
    assert delta.manifest.blob_bytes == len(delta.blob) and delta.manifest.full_bytes == sum(
        t.numel() * t.element_size() for t in new.values()
    )


def test_a_small_step_in_bf16_is_a_small_delta() -> None:
    base = _weights(0)
    delta = wd.encode(base, _stepped(base, 1e-6, 1), base_version="0", version="1")
    assert delta.manifest.changed_share < 0.05
    assert delta.manifest.share < 0.05


def test_a_delta_refuses_weights_that_are_not_its_base_and_changes_nothing() -> None:
    base = _weights(0)
    delta = wd.encode(base, _stepped(base, 1e-2, 1), base_version="0", version="1")
    other = {n: t.clone() for n, t in base.items()}
    other["layer.0.weight"][0, 0] += 1  # one weight off: a missed update, a corrupted load
    before = {n: t.clone() for n, t in other.items()}
    with pytest.raises(wd.DeltaMismatch, match="layer.0.weight"):
        wd.apply(other, delta)
    other_norm = {**base, "norm.weight": base["norm.weight"] * 2}  # an unchanged tensor is checked too
    with pytest.raises(wd.DeltaMismatch, match="norm.weight"):
        wd.apply(other_norm, delta)
    assert all(torch.equal(other[n], before[n]) for n in other)
    with pytest.raises(wd.DeltaMismatch, match="float32"):
        wd.apply({n: t.float() for n, t in base.items()}, delta)
    with pytest.raises(wd.DeltaMismatch, match="differ in names"):
        wd.apply({**base, "extra": torch.zeros(1, dtype=torch.bfloat16)}, delta)


def test_a_corrupt_or_oversized_blob_is_refused(tmp_path) -> None:
    base = _weights(0)
    delta = wd.encode(base, _stepped(base, 1e-2, 1), base_version="0", version="1")
    flipped = bytearray(delta.blob)
    flipped[len(flipped) // 2] ^= 0xFF
    with pytest.raises(wd.DeltaMismatch):
        wd.apply(base, wd.WeightDelta(delta.manifest, bytes(flipped)))
    # a tensor's bytes that would expand past the tensor (a decompression bomb) stop at its size
    import msgspec
    import zstandard

    bomb = zstandard.ZstdCompressor().compress(b"\0" * (1 << 24))
    t0 = next(t for t in delta.manifest.tensors if t.encoding == "xor-zstd")
    tensors = [
        msgspec.structs.replace(t, offset=0, length=len(bomb) if t is t0 else 0) if t.encoding != "unchanged" else t
        for t in delta.manifest.tensors
    ]
    manifest = msgspec.structs.replace(delta.manifest, tensors=tensors, blob_bytes=len(bomb))
    with pytest.raises(wd.DeltaMismatch, match="corrupt|bytes"):
        wd.apply(base, wd.WeightDelta(manifest, bomb))
    outside = msgspec.structs.replace(delta.manifest, tensors=[msgspec.structs.replace(t0, length=10**9)])
    with pytest.raises(wd.DeltaMismatch, match="outside the blob"):
        wd.check_manifest(outside, len(delta.blob))


def test_on_disk_a_delta_is_whole_or_refused(tmp_path) -> None:
    base = _weights(0)
    delta = wd.encode(base, _stepped(base, 1e-2, 1), base_version="0", version="1")
    path = wd.write(tmp_path / "d1", delta)
    assert wd.is_delta_dir(path) and sorted(p.name for p in tmp_path.iterdir()) == ["d1"]
    back = wd.read(path)
    assert back.manifest == delta.manifest and back.blob == delta.blob
    (path / wd.BLOB_FILE).write_bytes(delta.blob[:-1])  # torn
    with pytest.raises(wd.DeltaMismatch, match="blob has"):
        wd.read(path)
    (path / wd.MANIFEST_FILE).write_bytes(b'{"format": "x"}')
    with pytest.raises(wd.DeltaMismatch, match="not a readable"):
        wd.read(path)
