"""Datasets: deterministic batches per microbatch, shaped for the model, clear errors."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from dreampipe.errors import ConfigError, DatasetError
from dreampipe.models import get_model
from dreampipe.models.datasets import load_dataset

__all__: list[str] = []


def test_batches_are_a_deterministic_shuffled_stream() -> None:
    spec = get_model("mlp", layers=2, width=8)
    a = load_dataset("synthetic", spec, seed=4)
    b = load_dataset("synthetic", spec, seed=4)
    x1 = a.batch(3, 16)[0]
    torch.testing.assert_close(b.batch(3, 16)[0], x1)
    big_x, big_y = a.batch(0, 64)
    torch.testing.assert_close(torch.cat([a.batch(u, 16)[0] for u in range(4)]), big_x)
    torch.testing.assert_close(torch.cat([a.batch(u, 16)[1] for u in range(4)]), big_y)
    n = a.train_x.shape[0]
    epoch = torch.cat([a.batch(u, 64)[1] for u in range(n // 64)])
    assert sorted(epoch.tolist()) == sorted(a.train_y.tolist())
    assert not torch.equal(a.batch(n // 64, 64)[0], a.batch(0, 64)[0])
    other = load_dataset("synthetic", spec, seed=5)
    assert not torch.equal(other.batch(3, 16)[0], x1)


def test_a_microbatch_may_straddle_two_epochs() -> None:
    spec = get_model("cnn", image_size=8)
    data = load_dataset("digits", spec)
    n = data.train_x.shape[0]
    x, y = data.batch(1, n - 10)
    assert x.shape == (n - 10, 1, 8, 8)
    assert y.shape == (n - 10,)


def test_digits_fit_image_and_flat_models() -> None:
    data = load_dataset("digits", get_model("cnn", image_size=28))
    assert data.train_x.shape == (1437, 1, 28, 28)
    assert data.test_x is not None and data.test_x.shape == (360, 1, 28, 28)
    assert abs(float(data.train_x.mean())) < 0.2
    flat = load_dataset("digits", get_model("mlp", layers=2, width=8, in_features=100))
    assert flat.train_x.shape == (1437, 100)
    assert torch.all(flat.train_x[:, 64:] == 0)
    with pytest.raises(DatasetError, match="takes 32 features per sample but digits"):
        load_dataset("digits", get_model("mlp", layers=2, width=8, in_features=32))


def _idx(path: Path, array: np.ndarray, compress: bool) -> None:
    header = struct.pack(">BBBB", 0, 0, 8, array.ndim) + b"".join(
        struct.pack(">I", d) for d in array.shape
    )
    raw = header + array.astype(np.uint8).tobytes()
    if compress:
        (path.parent / (path.name + ".gz")).write_bytes(gzip.compress(raw))
    else:
        path.write_bytes(raw)


def test_mnist_reads_idx_files(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    _idx(tmp_path / "train-images-idx3-ubyte", rng.integers(0, 255, (20, 28, 28)), True)
    _idx(tmp_path / "train-labels-idx1-ubyte", np.arange(20) % 10, False)
    _idx(tmp_path / "t10k-images-idx3-ubyte", rng.integers(0, 255, (6, 28, 28)), False)
    _idx(tmp_path / "t10k-labels-idx1-ubyte", np.arange(6) % 10, True)
    data = load_dataset("mnist", get_model("cnn"), data_dir=str(tmp_path))
    assert data.train_x.shape == (20, 1, 28, 28)
    assert data.train_y.tolist() == [i % 10 for i in range(20)]
    assert data.test_y is not None and data.test_y.shape == (6,)


def test_missing_mnist_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"train-images-idx3-ubyte .* not found"):
        load_dataset("mnist", get_model("cnn"), data_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="needs data_dir="):
        load_dataset("mnist", get_model("cnn"))
    with pytest.raises(DatasetError, match="unknown dataset 'cifar'"):
        load_dataset("cifar", get_model("cnn"))
