"""A JSON file a user gives (a device map, an acceptance file, a head's config.json, a results.json)
is read by one function, ``treespec.files.read_json``: its value, or one line that names the file's
role, the file, what is wrong and the fix."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from treespec.cli.app import app
from treespec.errors import ConfigError, ModelLoadError
from treespec.files import read_json

CASES = [
    (None, "not found"),
    ("{not json", "is not JSON (Expecting property name"),
    (b"\xff\xfe{}", "is not JSON (not UTF-8 text)"),
    ("[1, 2]", "holds a list, not an object"),
    ('"text"', "holds a string, not an object"),
    ("null", "holds null, not an object"),
]


def _write(path, content):
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)


@pytest.mark.parametrize("content,needle", CASES)
def test_a_bad_file_is_one_line_with_its_role_and_fix(tmp_path, content, needle):
    path = tmp_path / "map.json"
    _write(path, content)
    with pytest.raises(ConfigError) as info:
        read_json(path, "--device-map", "give a JSON object")
    message = str(info.value)
    assert "\n" not in message and needle in message
    assert message.startswith(f"--device-map {path} ") and message.endswith("; give a JSON object")


def test_the_value_and_the_kinds_asked_for(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(json.dumps({"x": [1, 2.5]}))
    assert read_json(path, "file", "fix") == {"x": [1, 2.5]}
    path.write_text("[0.5, 0.25]")
    assert read_json(path, "file", "fix", kind=list) == [0.5, 0.25]
    assert read_json(path, "file", "fix", kind=None) == [0.5, 0.25]
    with pytest.raises(ModelLoadError, match="holds a list, not an object; fix"):
        read_json(path, "head 'h':", "fix", ModelLoadError)


def test_a_folder_is_not_a_file_and_an_unreadable_file_says_so(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"is not a file; fix$"):
        read_json(tmp_path, "acceptance file", "fix")
    path = tmp_path / "a.json"
    path.write_text("{}")

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(type(path), "read_text", denied)
    with pytest.raises(ConfigError, match=r"a.json cannot be read \(Permission denied\); fix$"):
        read_json(path, "acceptance file", "fix")


def test_only_objects_and_lists_are_asked_for(tmp_path):
    with pytest.raises(ValueError, match="kind is dict, list or None"):
        read_json(tmp_path / "a.json", "file", "fix", kind=float)


@pytest.mark.parametrize("content,needle", [c for c in CASES if c[0] is not None])
def test_callers_say_it_in_one_line(tmp_path, content, needle):
    """Callers through their own entry points: a device map given to ``device_placement`` (what a load
    is placed by) and ``bench-report``."""
    pytest.importorskip("accelerate")  # --device-map needs it
    from treespec.devices import device_placement

    path = tmp_path / "results.json"
    _write(path, content)
    with pytest.raises(ConfigError) as info:
        device_placement(str(path), None, None)
    assert str(info.value).startswith(f"--device-map {path} ") and needle in str(info.value)
    res = CliRunner().invoke(app, ["bench-report", str(path), "--out", str(tmp_path / "b.md")])
    assert res.exit_code == 2 and needle in res.output and res.output.count("\n") == 1, res.output


def test_a_heads_config_and_an_acceptance_list(tmp_path):
    """A head's config.json (``what`` ends in a colon: the head's name comes first) is a ModelLoadError;
    sequoia takes an object or a bare list (``kind=None``)."""
    from treespec.plugins.eagle_head import read_config
    from treespec.plugins.sequoia import load_acceptance

    (tmp_path / "config.json").write_text("[1]")
    with pytest.raises(ModelLoadError, match=rf"^EAGLE head '{tmp_path}': {tmp_path}/config.json holds a list"):
        read_config(str(tmp_path))
    acc = tmp_path / "acc.json"
    acc.write_text("[0.5, 0.25]")
    assert load_acceptance(str(acc)) == (0.5, 0.25)
    acc.write_text("{bad")
    with pytest.raises(ConfigError, match=r"^sequoia: acceptance file .*acc.json is not JSON"):
        load_acceptance(str(acc))
