"""How long ``python -m xlatorch.check`` takes on a BERT-base-sized model (12 layers, hidden 768,
sequence 128, batch 2; Hugging Face's ``BertForMaskedLM``), against the first real training
step of the same model (``--real``). Not a test: it prints the figures of one run.

Usage: python -m bench.static_check [--real] [--layers N]
"""

from __future__ import annotations

import argparse
import time


def bert_factory(layers: int):
    import torch
    import transformers as tf

    def make():
        torch.manual_seed(0)
        model = tf.BertForMaskedLM(tf.BertConfig(num_hidden_layers=layers))
        ids = torch.randint(0, 30522, (2, 128))
        return model, {"input_ids": ids, "labels": ids}, lambda out: out.loss

    return make


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--real", action="store_true", help="also run one real training step (compiles: minutes)")
    ap.add_argument("--layers", type=int, default=12)
    a = ap.parse_args()
    from xlatorch.check import check

    make = bert_factory(a.layers)
    t = time.perf_counter()
    make()
    print(f"factory (building the model on CPU): {time.perf_counter() - t:.2f} s")
    for lower in (True, False):
        for run in (1, 2):
            r = check(make, lower=lower)
            print(
                f"dry run, 3 steps, lowering traced={lower}, run {run}: {r.seconds:.2f} s, {len(r.findings)} findings"
            )
    if a.real:
        r = check(make, steps=1, dry_run=False)
        print(f"one real step (compile and run): {r.seconds:.2f} s")


if __name__ == "__main__":
    main()
