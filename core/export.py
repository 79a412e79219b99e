"""A trained (or imported) head -> a serving folder (`draftsmith export`).

`head_path` may be one of our head folders or a foreign one (official EAGLE/EAGLE-3, speculators,
FasterDecoding or vLLM Medusa), which is imported first; `format=native` therefore also converts
foreign heads into ours. The target named by `target=` must be the one the head was built for.
"""

from __future__ import annotations

from pathlib import Path

from draftsmith.conf.schema import Config
from draftsmith.heads import TargetInfo, TargetParts, load_head
from draftsmith.heads.formats import export_head
from draftsmith.provenance import export_dir, record_export
from draftsmith.target import load_config, load_target, target_name


def run(cfg: Config) -> Path:
    e = cfg.export  # its format is one of FORMATS (checked with the config)
    trust, revision = cfg.target.trust_remote_code, cfg.target.revision
    # the head borrows the target's embeddings, final norm and lm_head only (an 8B target's
    # layers would take ~30 GB of RAM in fp32 here)
    target = load_target(cfg.target.path, "float32", "cpu", trust, layers=False, revision=revision)
    info = TargetInfo.from_hf_config(
        load_config(cfg.target.path, trust, revision), target_name(cfg.target.path)
    )
    head = load_head(cfg.resolved_head_path(), info).bind(TargetParts.from_model(target))
    out = Path(export_dir(cfg))
    export_head(head, e.format, out, e.overwrite, e.num_speculative_tokens)
    record_export(cfg)
    print(f"export: {head.name} head -> {e.format} folder {out}")
    return out
