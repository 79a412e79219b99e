"""Hydra configuration: YAML groups in this folder over the dataclass schemas in `schema.py`."""

from pathlib import Path

CONF_DIR = str(Path(__file__).resolve().parent)
