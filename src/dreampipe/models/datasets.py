"""Training data every rank can index identically: ``Dataset.batch(microbatch, size)``.

The training split is a stream of samples, reshuffled each epoch by a
permutation seeded with ``(seed, epoch)``. Microbatch ``u`` of ``size`` samples is
positions ``u*size .. (u+1)*size-1`` of that stream, so any rank (the input
stage for the inputs, the last stage for the labels) computes the same batch
for the same microbatch without talking to anyone::

    stream   | epoch 0: perm_0(0..n-1) | epoch 1: perm_1(0..n-1) | ...
    microbatch u   |  [u*size, (u+1)*size)  (may straddle an epoch boundary)

Datasets:

- ``synthetic``: a fixed pool of samples drawn with the model's own
  ``sample_input`` / ``sample_target`` under ``seed``; no test split.
- ``digits``: scikit-learn's 1797 handwritten 8x8 digits, a fixed 1437/360
  train/test split, standardised, resized to the model's input.
- ``mnist``: the four IDX files (optionally ``.gz``) in ``data_dir``.
"""

from __future__ import annotations

import gzip
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from dreampipe.errors import ConfigError, DatasetError
from dreampipe.models.spec import ModelSpec

__all__ = ["DATASETS", "Dataset", "load_dataset", "steps_for_epochs"]

DATASETS = ("synthetic", "digits", "mnist")
_SYNTHETIC_SAMPLES = 2048
_SYNTHETIC_BYTES = 64 * 2**20
_DIGITS_TRAIN = 1437
_SPLIT_SEED = 0
_MNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
_MNIST_MEAN, _MNIST_STD = 0.1307, 0.3081


@dataclass(frozen=True)
class Dataset:
    """Train (and optional test) tensors; ``batch`` is deterministic in (seed, microbatch)."""

    name: str
    train_x: Tensor
    train_y: Tensor
    test_x: Tensor | None = None
    test_y: Tensor | None = None
    seed: int = 0
    _perms: dict[int, Tensor] = field(default_factory=dict, repr=False, compare=False)

    @property
    def has_test(self) -> bool:
        """Whether a test split came with the data (synthetic has none)."""
        return self.test_x is not None and self.test_y is not None

    def batch(self, microbatch: int, size: int) -> tuple[Tensor, Tensor]:
        """Samples ``microbatch*size .. (microbatch+1)*size-1`` of the shuffled training stream."""
        sel = self._select(microbatch, size)
        return self.train_x[sel], self.train_y[sel]

    def _select(self, microbatch: int, size: int) -> Tensor:
        """Indices of microbatch ``microbatch``'s samples in the training split.

        A microbatch inside one epoch is a slice of that epoch's permutation, found
        with integer arithmetic: a training step calls this between large
        GEMMs that leave the CPU caches cold, where every extra small tensor
        op costs tens of microseconds, not one or two.
        """
        n = self.train_x.shape[0]
        start = microbatch * size
        first, last = start // n, (start + size - 1) // n
        if first == last:
            offset = start - first * n
            return self._perm(first)[offset : offset + size]
        pos = torch.arange(start, start + size)
        epochs = pos // n
        return torch.cat(
            [self._perm(e)[pos[epochs == e] % n] for e in range(first, last + 1)]
        )

    def _perm(self, epoch: int) -> Tensor:
        perm = self._perms.get(epoch)
        if perm is None:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            perm = torch.randperm(self.train_x.shape[0], generator=gen)
            self._perms.clear()
            self._perms[epoch] = perm
        return perm


def load_dataset(
    name: str, spec: ModelSpec, *, data_dir: str | None = None, seed: int = 0
) -> Dataset:
    """Load ``name`` (one of :data:`DATASETS`) shaped for ``spec``'s input."""
    if name == "synthetic":
        return _synthetic(spec, seed)
    if name == "digits":
        return _digits(spec, seed)
    if name == "mnist":
        return _mnist(spec, data_dir, seed)
    raise DatasetError(f"unknown dataset {name!r}; use one of {', '.join(DATASETS)}")


def _synthetic(spec: ModelSpec, seed: int) -> Dataset:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        probe = spec.sample_input(1)
        per_sample = max(1, probe.numel() * probe.element_size())
        n = max(64, min(_SYNTHETIC_SAMPLES, _SYNTHETIC_BYTES // per_sample))
        torch.manual_seed(seed)
        x = spec.sample_input(n)
        y = spec.sample_target(n)
    return Dataset("synthetic", x, y, seed=seed)


def _digits(spec: ModelSpec, seed: int) -> Dataset:
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise DatasetError(
            "the digits dataset comes from scikit-learn; install it with "
            "`pip install scikit-learn` (or `pip install dreampipe[data]`)"
        ) from exc
    bunch = load_digits()
    images = torch.as_tensor(np.asarray(bunch.images), dtype=torch.float32).unsqueeze(1)
    labels = torch.as_tensor(np.asarray(bunch.target), dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(_SPLIT_SEED))
    images, labels = images[order], labels[order]
    train, test = images[:_DIGITS_TRAIN], images[_DIGITS_TRAIN:]
    mean, std = train.mean(), train.std()
    return Dataset(
        "digits",
        _shape_for(spec, (train - mean) / std, "digits"),
        labels[:_DIGITS_TRAIN],
        _shape_for(spec, (test - mean) / std, "digits"),
        labels[_DIGITS_TRAIN:],
        seed=seed,
    )


def _mnist(spec: ModelSpec, data_dir: str | None, seed: int) -> Dataset:
    if data_dir is None:
        raise ConfigError(
            "the mnist dataset needs data_dir=DIR, a directory holding "
            + ", ".join(_MNIST_FILES) + " (each optionally .gz)", "data_dir",
        )
    arrays = [_read_idx(_find(Path(data_dir), f)) for f in _MNIST_FILES]
    train_x, train_y, test_x, test_y = (torch.as_tensor(a) for a in arrays)

    def norm(x: Tensor) -> Tensor:
        return (x.float().unsqueeze(1) / 255.0 - _MNIST_MEAN) / _MNIST_STD

    return Dataset(
        "mnist",
        _shape_for(spec, norm(train_x), "mnist"),
        train_y.long(),
        _shape_for(spec, norm(test_x), "mnist"),
        test_y.long(),
        seed=seed,
    )


def _find(directory: Path, stem: str) -> Path:
    for candidate in (directory / stem, directory / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    raise DatasetError(
        f"mnist: {stem} (or {stem}.gz) not found in {str(directory)!r}; the directory needs "
        + ", ".join(_MNIST_FILES)
    )


def _read_idx(path: Path) -> np.ndarray:
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 8:
        raise DatasetError(f"{str(path)!r} is not an unsigned-byte IDX file")
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise DatasetError(f"{str(path)!r} holds {data.size} bytes of data, expected {dims}")
    return data.reshape(dims).copy()


def _shape_for(spec: ModelSpec, images: Tensor, name: str) -> Tensor:
    """Fit (N, 1, H, W) images to the model's input: resize, repeat channels or flatten."""
    with torch.random.fork_rng(devices=[]):
        probe = spec.sample_input(1)
    if not probe.is_floating_point():
        raise DatasetError(
            f"model {spec.name} takes {probe.dtype} inputs, not images; "
            f"{name} fits image or flat float models such as cnn or mlp"
        )
    if probe.dim() == 4:
        channels, size = probe.shape[1], tuple(probe.shape[2:])
        if tuple(images.shape[2:]) != size:
            images = F.interpolate(images, size=size, mode="bilinear", align_corners=False)
        return images.expand(-1, channels, -1, -1).contiguous()
    if probe.dim() == 2:
        flat = images.flatten(1)
        features = probe.shape[1]
        if features < flat.shape[1]:
            raise DatasetError(
                f"model {spec.name} takes {features} features per sample but {name} images "
                f"have {flat.shape[1]} pixels; use a model with at least {flat.shape[1]} inputs "
                f"(e.g. mlp with in_features={flat.shape[1]}) or an image model such as cnn"
            )
        return F.pad(flat, (0, features - flat.shape[1]))
    raise DatasetError(
        f"model {spec.name} takes inputs of shape {tuple(probe.shape)}; {name} fits "
        "(N, C, H, W) image models or (N, features) flat models"
    )


def steps_for_epochs(epochs: float, train_samples: int, minibatch_size: int) -> int:
    """Weight updates (PipeDream: minibatches) that cover ``epochs`` passes over the data."""
    if epochs <= 0:
        raise ConfigError(f"epochs={epochs}: use a positive number of epochs", "epochs")
    return max(1, math.ceil(epochs * train_samples / minibatch_size))
