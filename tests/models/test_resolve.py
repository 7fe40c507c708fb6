"""The MODEL resolver: malformed references, mistyped model arguments, running out of memory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dreampipe.errors import ConfigError
from dreampipe.models.resolve import memory_error, resolve
from dreampipe.models.spec import ModelSpec

__all__: list[str] = []

_USER_FILE = """
from dreampipe.models import get_model

def named(act: str = "relu", layers: int | None = None):
    assert isinstance(act, str), act
    return get_model("mlp", layers=layers or 2, width=8)

def loose(layers=2):
    return get_model("mlp", layers=layers, width=8)

def hungry():
    raise MemoryError()
"""


@pytest.mark.parametrize("ref", [":f", "mlp:", "a..b:f", "x.py:", ".mod:f", "pkg.:f", "m:a.b"])
def test_a_malformed_reference_is_one_line_naming_it_and_the_forms(ref: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve(ref)
    message = str(info.value)
    assert f"model {ref!r} is not a zoo name" in message
    assert "'package.module:function' or 'path/to/file.py:function'" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("ref", "kwargs", "needle"),
    [
        ("mlp", (("layers", "abc"),),
         "model 'mlp': layers='abc' is text, but mlp() takes a whole number (int) for layers; "
         "give e.g. layers=8"),
        ("mlp", (("width", 1e9),),
         "width=1000000000.0 is a float, but mlp() takes a whole number (int) for width; "
         "give e.g. width=1000000000"),
        ("mlp", (("width", 2.5),), "width=2.5 is a float, but mlp() takes a whole number"),
        ("transformer", (("dropout", "x"),),
         "dropout='x' is text, but transformer() takes a number (float) for dropout"),
        ("{dir}/user.py:named", (("layers", "x"),),
         "layers='x' is text, but named() takes a whole number (int) for layers"),
    ],
)
def test_a_mistyped_model_argument_names_it_its_value_and_the_type(
    tmp_path: Path, ref: str, kwargs: tuple[tuple[str, Any], ...], needle: str
) -> None:
    (tmp_path / "user.py").write_text(_USER_FILE)
    with pytest.raises(ConfigError) as info:
        resolve(ref.format(dir=tmp_path), kwargs)
    assert needle in str(info.value)
    assert "\n" not in str(info.value)


def test_arguments_of_the_annotated_type_pass(tmp_path: Path) -> None:
    (tmp_path / "user.py").write_text(_USER_FILE)
    assert isinstance(resolve("transformer", (("dropout", 0), ("layers", 1))), ModelSpec)
    # a number given to a str parameter is its text (the command line reads "3" as 3)
    spec = resolve(f"{tmp_path}/user.py:named", (("act", 3), ("layers", 3)))
    assert isinstance(spec, ModelSpec) and spec.num_layers == 3


def test_an_unannotated_argument_keeps_the_functions_own_error(tmp_path: Path) -> None:
    (tmp_path / "user.py").write_text(_USER_FILE)
    with pytest.raises(ConfigError, match=r"user\.py:loose' with \{'layers': 'x'\}: "):
        resolve(f"{tmp_path}/user.py:loose", (("layers", "x"),))


_TORCH_OOM = ("[enforce fail at alloc_cpu.cpp:127] data. DefaultCPUAllocator: can't allocate "
              "memory: you tried to allocate 25600000000 bytes. Error code 12")


def test_running_out_of_memory_is_one_line_naming_the_arguments() -> None:
    found = memory_error("mlp", (("width", 100000000),), RuntimeError(_TORCH_OOM))
    assert found is not None
    assert str(found) == (
        "model 'mlp' with width=100000000 ran out of memory (it asked for 25.6 GB at once); "
        "give it smaller model arguments (--model-arg), or profile a GPT by shape (gpt:...) "
        "without building it")
    assert "ran out of memory; give" in str(memory_error("mlp", (), MemoryError()))
    assert memory_error("mlp", (), RuntimeError("mat1 and mat2 shapes cannot be multiplied")) \
        is None


def test_a_model_function_out_of_memory_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "user.py").write_text(_USER_FILE)
    with pytest.raises(ConfigError, match="hungry' with its defaults ran out of memory"):
        resolve(f"{tmp_path}/user.py:hungry")
