"""formats: the registry of other projects' schedule codecs."""

from __future__ import annotations

import pytest

import dreampipe  # noqa: F401  (loads the codecs, as a user's import does)
from dreampipe.errors import ScheduleError
from dreampipe.scheduling import formats, torch_csv, torch_csv_write

__all__: list[str] = []


def test_the_package_loads_both_halves_of_the_torch_csv_codec() -> None:
    assert formats.codec("torch-csv") == (torch_csv.read_torch_csv,
                                           torch_csv_write.write_torch_csv)


def test_a_half_registered_format_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(formats, "_FORMATS", {})
    formats.register_format("demo", read=torch_csv.read_torch_csv)
    with pytest.raises(ScheduleError, match=r"no codec of the demo schedule format.*import"):
        formats.codec("demo")
    formats.register_format("demo", write=torch_csv_write.write_torch_csv)  # keeps the reader
    assert formats.codec("demo") == (torch_csv.read_torch_csv, torch_csv_write.write_torch_csv)
