"""Reading configs: YAML files, ``key=value`` overrides, and the device check."""

from __future__ import annotations

import importlib.resources
import os
from collections.abc import Mapping, Sequence
from typing import Any

from meshkit._fs import read_text_file
from meshkit._yamlfile import YAMLFileError, load_yaml
from meshkit.config.sections import SECTIONS, Config, MeshConfig, all_keys
from meshkit.config.values import ConfigError, show, unknown
from meshkit.errors import UsageError


def _yaml_load(text: str, where: str) -> Any:
    try:
        return load_yaml(text, where=where)
    except YAMLFileError as e:
        raise ConfigError(str(e)) from None


def _parse_override(item: str) -> tuple[str, Any]:
    if not isinstance(item, str) or "=" not in item:
        raise ConfigError(f"override {show(item)} is not key=value (e.g. train.steps=50)")
    key, text = item.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {show(item)} has an empty key (e.g. train.steps=50)")
    return key, _yaml_load(text, key)


def _apply_override(raw: dict[str, Any], key: str, value: Any) -> None:
    """Set dotted ``key`` in the raw nested dict; ``mesh.axes.NAME`` sets one axis."""
    parts = key.split(".")
    if len(parts) < 2 or parts[1] not in (
            SECTIONS[parts[0]].model_fields if parts[0] in SECTIONS else ()):
        raise unknown(key, all_keys())
    section = raw.get(parts[0])
    if section is not None and not isinstance(section, Mapping):
        return  # a bad section: Config.from_dict names it
    section = raw[parts[0]] = dict(section or {})
    if len(parts) == 2:
        section[parts[1]] = value
        return
    if parts[:2] != ["mesh", "axes"] or len(parts) != 3:
        raise unknown(key, all_keys())
    axes = section.get("axes", MeshConfig.model_fields["axes"].default)
    if not isinstance(axes, Mapping):
        MeshConfig(axes=axes)  # raises the error naming mesh.axes
    if parts[2] not in axes:
        raise unknown(key, [f"mesh.axes.{a}" for a in axes])
    section["axes"] = {**axes, parts[2]: value}


def _apply_overrides(raw: Any, overrides: Sequence[str]) -> Config:
    if isinstance(overrides, str):
        raise ConfigError(f"overrides must be a list of key=value strings, got {overrides!r}")
    raw = {} if raw is None else raw
    if isinstance(raw, Mapping):  # else Config.from_dict names the problem
        raw = dict(raw)
        for item in overrides:
            _apply_override(raw, *_parse_override(item))
    return Config.from_dict(raw)


def load_config(
    path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = ()
) -> Config:
    """Load a YAML config, apply ``key=value`` overrides and validate the result once.

    Missing keys take their defaults. Override values are YAML (``3e-3``, ``null``,
    ``[ep, tp]``, ``{node: 1, device: 8}``); ``mesh.axes.NAME=SIZE`` resizes one axis.

    Args:
        path: a YAML file, or ``None`` for the embedded default (2 nodes × 4 devices).
        overrides: ``"section.key=value"`` strings, applied in order.

    Returns:
        The validated, read-only config.

    Raises:
        ConfigError: a missing file, one that is not a regular file or is over
            :data:`meshkit._fs.MAX_TEXT_FILE_BYTES`, invalid YAML or a duplicate key, a malformed
            override, an unknown key (naming the closest valid one), a bad value or a
            failed check (naming the dotted key).

    Examples:
        >>> load_config(None, ["model.capacity_factor=2"]).model.capacity_factor
        2.0
        >>> with_overrides(Config(), ["mesh.axes={node: 4, device: 2}"]).strategy()
        Strategy(node=4, device=2)
    """
    if path is None:
        where = "meshkit/config/default.yaml"
        text = importlib.resources.files("meshkit.config").joinpath("default.yaml").read_text()
    else:
        where = os.fspath(path)
        text = _read_text(where)
    return _apply_overrides(_yaml_load(text, where), overrides)


def _read_text(path: str) -> str:
    try:
        return read_text_file(path, what="config file")
    except UsageError as e:
        raise ConfigError(str(e)) from None


def read_config_file(path: str | os.PathLike[str]) -> Any:
    """Parse a YAML config file as plain data: no defaults filled in, nothing validated.

    For a workdir's ``config.yaml``: a damaged file shows before defaults fill it in.

    Args:
        path: the YAML file.

    Returns:
        Whatever the YAML holds (a mapping, for a config).

    Raises:
        ConfigError: a missing file, a directory, pipe or device, a file over
            :data:`meshkit._fs.MAX_TEXT_FILE_BYTES`, bytes that are not UTF-8, invalid
            YAML or a duplicate key; the message names the file and the line.

    Examples:
        >>> import pathlib, tempfile
        >>> path = pathlib.Path(tempfile.mkdtemp(), "config.yaml")
        >>> _ = path.write_text("{train: {steps: 5}, model: null}")
        >>> read_config_file(path)
        {'train': {'steps': 5}, 'model': None}
    """
    where = os.fspath(path)
    return _yaml_load(_read_text(where), where)


def with_overrides(config: Config, overrides: Sequence[str]) -> Config:
    """A copy of ``config`` with ``key=value`` overrides applied, validated again.

    Args:
        config: the starting config (unchanged; configs are read-only).
        overrides: ``"section.key=value"`` strings, as for :func:`load_config`.

    Returns:
        The new config.

    Raises:
        ConfigError: as :func:`load_config`.

    Examples:
        >>> with_overrides(Config(), ["train.steps=10", "train.warmup_steps=0"]).train.steps
        10
    """
    return _apply_overrides(config.to_dict(), overrides)


def check_devices(config: Config, num_devices: int) -> None:
    """Check that the mesh fits on the available devices (call once JAX has started).

    Args:
        config: the config.
        num_devices: devices available, e.g. ``len(jax.devices())``.

    Raises:
        ConfigError: the strategy needs more devices than there are (names ``mesh``).

    Examples:
        >>> check_devices(Config(), 8)
    """
    if config.num_devices > num_devices:
        raise ConfigError(
            f"mesh: mesh needs {config.num_devices} devices but only {num_devices} are "
            f"available (mesh.axes: {dict(config.strategy().shape)})")
