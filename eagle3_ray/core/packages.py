"""Data files shipped inside installed distributions (the real model's GGUF, ShareGPT, MT-Bench, HumanEval): found
through `importlib.metadata`, so nothing is downloaded at run time; a missing package is a one-line UserError that
names the install command."""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

from eagle3_ray.core.config import UserError


@dataclass(frozen=True, slots=True)
class PackageFile:
    """A data file inside an installed distribution."""

    package: str
    file: str
    install: str
    """The command that installs it (the fix named in the error when it is missing)."""

    def locate(self, where: str = "") -> Path:
        """The file's path in the installed distribution (unchecked); `where` prefixes the error."""
        try:
            dist = importlib.metadata.distribution(self.package)
        except importlib.metadata.PackageNotFoundError:
            raise UserError(f"{where}the package {self.package} is not installed; run `{self.install}`") from None
        return Path(str(dist.locate_file(self.file)))

    def path(self) -> Path:
        """The file's path; a missing or empty file is a UserError naming it and the reinstall command."""
        path = self.locate()
        if not path.is_file() or path.stat().st_size == 0:
            state = "is empty (0 bytes)" if path.is_file() else "is missing"
            raise UserError(f"{path} {state}; reinstall it: `{self.install} --force-reinstall`")
        return path

    def version(self) -> str:
        return importlib.metadata.version(self.package)
