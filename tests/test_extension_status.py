"""doctor and loader.io say what of the C++ extension is missing and what that costs (issue 19);
a missing extension or libjpeg is simulated by replacing what engine imported."""

import json
import types

import pytest
import torch

import torch_fastload
from torch_fastload import doctor, engine, extension
from torch_fastload import io as fio


@pytest.fixture
def no_extension(monkeypatch):
    monkeypatch.setattr(engine, "_C", None)
    monkeypatch.setattr(engine, "_IMPORT_ERROR", ImportError("No module named 'torch_fastload._C'"))


@pytest.fixture
def no_libjpeg(monkeypatch):
    monkeypatch.setattr(engine, "_C", types.SimpleNamespace(HAVE_LIBJPEG=False, JPEG_REGIONS=False))


def test_missing_extension_names_what_it_costs(no_extension):
    status = extension.status()
    assert not status.built and not status.complete
    (line,) = status.missing()
    assert "torch_fastload._C is not built (ImportError: No module named 'torch_fastload._C')" in line
    assert "os.pread" in line and "PIL" in line and "no batched libjpeg-turbo decode" in line
    assert "To build it" in line and "compiler" in line


def test_loader_io_says_the_extension_is_missing(no_extension):
    path = fio.select("auto", "cpu")
    assert path.mode == "python-posix"
    text = str(path)
    assert "torch_fastload._C is not built" in text and "Python fallbacks run instead" in text
    loader = torch_fastload.DataLoader(torch.utils.data.TensorDataset(torch.zeros(8, 2)), batch_size=4)
    try:
        assert "not built" in str(loader.io)
    finally:
        loader.close()


def test_extension_without_libjpeg_is_said(no_libjpeg):
    status = extension.status()
    assert status.built and not status.libjpeg
    (line,) = status.missing()
    assert "built without libjpeg" in line and "PIL" in line and "libjpeg-turbo8-dev" in line
    assert "built without libjpeg" in str(fio.select("auto", "cpu"))


def test_complete_extension_adds_nothing():
    if not extension.status().complete:
        pytest.skip(f"this checkout's extension is not complete: {extension.status().short()}")
    assert extension.status().missing() == []
    assert fio.select("auto", "cpu").extension == ""


@pytest.mark.parametrize("fixture", ["no_extension", "no_libjpeg"])
def test_doctor_says_what_is_missing(fixture, request, tmp_path, monkeypatch, capsys):
    request.getfixturevalue(fixture)
    monkeypatch.setattr(doctor.cli, "_measure", lambda plan: {})  # the header alone
    out = tmp_path / "doctor.json"
    assert doctor.main(["--quick", "--dir", str(tmp_path), "--no-progress", "--json", str(out)], prog="doctor") == 0
    printed = capsys.readouterr().out
    expected = "NOT built (Python fallbacks)" if fixture == "no_extension" else "built, without libjpeg"
    assert f"C++ extension {expected}" in printed
    assert "missing: the C++ extension" in printed and "To " in printed
    report = json.loads(out.read_text())["extension"]
    assert report["built"] == (fixture == "no_libjpeg") and report["libjpeg"] is False and report["missing"]
