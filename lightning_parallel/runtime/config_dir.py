"""Where the bundled Hydra configs are, computed once for the commands, the planner and the tests."""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent.parent

#: The Hydra config folder: inside the package once installed (the wheel carries ``conf/`` as
#: ``lightning_parallel/conf``), else ``conf/`` beside the package (a source checkout, editable or not).
CONFIG_DIR: Path = _PACKAGE / "conf" if (_PACKAGE / "conf" / "config.yaml").is_file() else _PACKAGE.parent / "conf"
