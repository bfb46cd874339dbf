"""Test-only Flower apps: the project's pyproject with its ClientApp wrapped by a test module.

The project's own app never changes: a test writes a folder holding a copy of pyproject.toml whose
`clientapp` points at a small module that wraps `clients.app:app`, the wrapping module from tests/
and its JSON settings; `flwr run <folder>` ships exactly that. No run config and no server message
can switch these behaviours on in the real app. (Flower leaves `test_*.py` out of the app it
ships, hence the module's name, `wrapped_app`.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[2]


def wrapped_app(folder: Path, kit: str, wrapper: str, settings_name: str, settings: dict) -> Path:
    """A Flower app in `folder` whose ClientApp is `<kit>.<wrapper>(clients.app:app, ...)`.

    `kit` is a module of tests/ (copied in); `wrapper` is the source of the app module's last line
    (it sees `real`, the project's ClientApp, and `HERE`, the app folder).
    """
    folder.mkdir()
    pyproject = (PROJECT / "pyproject.toml").read_text()
    assert 'clientapp = "clients.app:app"' in pyproject
    (folder / "pyproject.toml").write_text(
        pyproject.replace('clientapp = "clients.app:app"', 'clientapp = "wrapped_app:app"')
    )
    (folder / "wrapped_app.py").write_text(
        '"""Test-only ClientApp: the real one, wrapped (see tests/e2e/testapps.py)."""\n'
        "from pathlib import Path\n\n"
        "from clients.app import app as real\n"
        f"import {kit}\n\n"
        "HERE = Path(__file__).resolve().parent\n"
        f"app = {wrapper}\n"
    )
    for module in {"faultkit", kit}:  # faultkit holds the wrapping every kit shares
        shutil.copy(PROJECT / "tests" / f"{module}.py", folder / f"{module}.py")
    (folder / settings_name).write_text(json.dumps(settings))
    return folder
