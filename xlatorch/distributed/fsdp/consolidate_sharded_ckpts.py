"""``python -m xlatorch.distributed.fsdp.consolidate_sharded_ckpts --ckpt_prefix P [--ckpt_suffix S]
[--save_path F]``: one full model checkpoint from FSDP's per-rank checkpoints."""

from __future__ import annotations

import argparse

from xlatorch.distributed.fsdp.state_dict_utils import consolidate_sharded_model_checkpoints


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ckpt_prefix", required=True, help="path prefix of the per-rank checkpoint files")
    p.add_argument("--ckpt_suffix", default="*.pth", help="glob completing the prefix (default *.pth)")
    p.add_argument("--save_path", default="", help="output file (default: <prefix>_consolidated.pth)")
    a = p.parse_args(argv)
    consolidate_sharded_model_checkpoints(a.ckpt_prefix, a.ckpt_suffix, a.save_path)


if __name__ == "__main__":
    main()
