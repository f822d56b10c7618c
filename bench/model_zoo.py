"""A zoo of small Hugging Face models (random init, tiny configs), each trained a few steps on
the xla device and in PyTorch eager on CPU: do the losses agree, which ATen ops fell back to CPU,
how many graphs a step executes, how many compiles the steady steps make, and the steady step's
time against eager's. Not a test: a survey that finds the ops a real architecture sends to CPU
(each fallback cuts the step's graph: a sync, two transfers and a compile more per cut).

Models run in eval mode (dropout off, batch norm on its running statistics) so that losses can be
compared; gradients and AdamW's update still run. Each model runs in a process of its own.

Needs ``transformers`` (``pip install -e '.[bench]'``).

Usage: python -m bench.model_zoo [--models gpt2,bert,...] [--steps 4]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V = 128  # vocabulary of the text models


def _text(cls, cfg, **kw):
    return lambda T: (getattr(T, cls)(getattr(T, cfg)(vocab_size=V, **kw)), "text")


# name -> (factory of (model, batch kind)); configs small enough to compile in seconds
MODELS = {
    "gpt2": _text("GPT2LMHeadModel", "GPT2Config", n_layer=2, n_embd=32, n_head=4, n_positions=64),
    "bert": _text("BertForMaskedLM", "BertConfig", num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                  intermediate_size=64),
    "roberta": _text("RobertaForMaskedLM", "RobertaConfig", num_hidden_layers=2, hidden_size=32,
                     num_attention_heads=4, intermediate_size=64),
    "distilbert": _text("DistilBertForMaskedLM", "DistilBertConfig", n_layers=2, dim=32, n_heads=4, hidden_dim=64),
    "albert": _text("AlbertForMaskedLM", "AlbertConfig", num_hidden_layers=2, hidden_size=32, embedding_size=16,
                    num_attention_heads=4, intermediate_size=64),
    "electra": _text("ElectraForMaskedLM", "ElectraConfig", num_hidden_layers=2, hidden_size=32, embedding_size=16,
                     num_attention_heads=4, intermediate_size=64),
    "deberta_v2": _text("DebertaV2ForMaskedLM", "DebertaV2Config", num_hidden_layers=2, hidden_size=32,
                        num_attention_heads=4, intermediate_size=64),
    "t5": _text("T5ForConditionalGeneration", "T5Config", num_layers=2, num_decoder_layers=2, d_model=32, d_kv=8,
                d_ff=64, num_heads=4, decoder_start_token_id=0),
    "bart": _text("BartForConditionalGeneration", "BartConfig", encoder_layers=2, decoder_layers=2, d_model=32,
                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64),
    "llama": _text("LlamaForCausalLM", "LlamaConfig", num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=64),
    "mistral": _text("MistralForCausalLM", "MistralConfig", num_hidden_layers=2, hidden_size=32,
                     num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, sliding_window=8),
    "qwen2": _text("Qwen2ForCausalLM", "Qwen2Config", num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=64),
    "gemma": _text("GemmaForCausalLM", "GemmaConfig", num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=64, head_dim=8),
    "phi": _text("PhiForCausalLM", "PhiConfig", num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                 intermediate_size=64),
    "opt": _text("OPTForCausalLM", "OPTConfig", num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                 ffn_dim=64, word_embed_proj_dim=32, max_position_embeddings=64),
    "gpt_neox": _text("GPTNeoXForCausalLM", "GPTNeoXConfig", num_hidden_layers=2, hidden_size=32,
                      num_attention_heads=4, intermediate_size=64),
    "bloom": _text("BloomForCausalLM", "BloomConfig", n_layer=2, hidden_size=32, n_head=4),
    "falcon": _text("FalconForCausalLM", "FalconConfig", num_hidden_layers=2, hidden_size=32, num_attention_heads=4),
    "gptj": _text("GPTJForCausalLM", "GPTJConfig", n_layer=2, n_embd=32, n_head=4, rotary_dim=4, n_positions=64),
    "mixtral": _text("MixtralForCausalLM", "MixtralConfig", num_hidden_layers=2, hidden_size=32,
                     num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, num_local_experts=4,
                     num_experts_per_tok=2),
    "qwen2_moe": _text("Qwen2MoeForCausalLM", "Qwen2MoeConfig", num_hidden_layers=2, hidden_size=32,
                       num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2),
    "xlnet": _text("XLNetLMHeadModel", "XLNetConfig", n_layer=2, d_model=32, n_head=4, d_inner=64),
    "longformer": _text("LongformerForMaskedLM", "LongformerConfig", num_hidden_layers=2, hidden_size=32,
                        num_attention_heads=4, intermediate_size=64, attention_window=[8, 8]),
    "big_bird": _text("BigBirdForMaskedLM", "BigBirdConfig", num_hidden_layers=2, hidden_size=32,
                      num_attention_heads=4, intermediate_size=64, attention_type="block_sparse", block_size=4,
                      num_random_blocks=2),
    "mamba": _text("MambaForCausalLM", "MambaConfig", num_hidden_layers=2, hidden_size=32, state_size=8),
    "vit": lambda T: (T.ViTForImageClassification(T.ViTConfig(
        image_size=32, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64)), "image"),
    "swin": lambda T: (T.SwinForImageClassification(T.SwinConfig(
        image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4)), "image"),
    "convnext": lambda T: (T.ConvNextForImageClassification(T.ConvNextConfig(
        num_channels=3, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], image_size=32)), "image"),
    "resnet": lambda T: (T.ResNetForImageClassification(T.ResNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1])), "image"),
    "mobilevit": lambda T: (T.MobileViTForImageClassification(T.MobileViTConfig(
        image_size=32, hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 32])), "image"),
    "wav2vec2": lambda T: (T.Wav2Vec2ForCTC(T.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, conv_dim=(16, 16),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
        vocab_size=V)), "audio"),
    "whisper": lambda T: (T.WhisperForConditionalGeneration(T.WhisperConfig(
        vocab_size=V, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16, max_source_positions=32,
        max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)),
        "whisper"),
    "clip": lambda T: (T.CLIPModel(T.CLIPConfig(
        text_config=dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4),
        vision_config=dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4))), "clip"),
}  # fmt: skip


def _batch(kind: str, g):
    import torch

    if kind == "text":
        ids = torch.randint(3, V, (2, 32), generator=g)
        return dict(input_ids=ids, labels=ids)
    if kind == "image":
        return dict(pixel_values=torch.randn(2, 3, 32, 32, generator=g), labels=torch.randint(0, 2, (2,), generator=g))
    if kind == "audio":
        return dict(input_values=torch.randn(2, 800, generator=g), labels=torch.randint(1, V, (2, 8), generator=g))
    if kind == "whisper":
        feats = torch.randn(2, 16, 64, generator=g)
        return dict(input_features=feats, labels=torch.randint(3, V, (2, 8), generator=g))
    ids = torch.randint(3, V, (2, 8), generator=g)
    return dict(input_ids=ids, pixel_values=torch.randn(2, 3, 32, 32, generator=g), return_loss=True)


def _child(name: str, steps: int) -> dict:
    """``steps`` training steps of one model on CPU, then on the xla device (same weights)."""
    import copy

    import torch
    import transformers

    sys.path.insert(0, ROOT)
    import xlatorch.core.xla_model as xm
    import xlatorch.debug.metrics as met

    torch.manual_seed(0)
    cpu_model, kind = MODELS[name](transformers)
    cpu_model.eval()
    xla_model = copy.deepcopy(cpu_model)
    batch = _batch(kind, torch.Generator().manual_seed(1))
    dev = xm.xla_device()

    def run(model, device):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
        losses, times, executions, compiles = [], [], [], []
        for _ in range(steps):
            e0 = (met.metric_data("ExecuteTime") or (0,))[0]
            c0 = met.counter_value("UncachedCompile") or 0
            t = time.perf_counter()
            opt.zero_grad()
            loss = model(**inputs).loss
            loss.backward()
            opt.step()
            if device is dev:
                xm.mark_step()
            losses.append(loss.item())
            times.append(time.perf_counter() - t)
            executions.append((met.metric_data("ExecuteTime") or (0,))[0] - e0)
            compiles.append((met.counter_value("UncachedCompile") or 0) - c0)
        return losses, times, executions, compiles

    cpu_losses, cpu_times, _, _ = run(cpu_model, torch.device("cpu"))
    met.clear_all()
    xla_model.to(dev)
    xm.mark_step()
    losses, times, executions, compiles = run(xla_model.to(dev), dev)
    fallbacks = {op: met.counter_value(op) for op in met.executed_fallback_ops()}
    return dict(model=name, cpu_losses=cpu_losses, losses=losses, cpu_s=cpu_times, s=times,
                executions=executions, compiles=compiles, fallbacks=fallbacks)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--steps", type=int, default=4, help="steps per device (the last half are the steady ones)")
    ap.add_argument("--child")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(_child(a.child, a.steps)))
        return
    if importlib.util.find_spec("transformers") is None:
        print("bench.model_zoo: transformers is not installed (pip install -e '.[bench]')")
        return
    print(f"{'model':11} {'max |loss - cpu|':>16} {'executions/step':>15} {'steady compiles':>15} "
          f"{'steady xla/cpu':>14}  fallbacks (calls over all steps)")  # fmt: skip
    for name in a.models.split(","):
        cmd = [sys.executable, "-m", "bench.model_zoo", "--child", name, "--steps", str(a.steps)]
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, XLATORCH_CACHE_DIR=""))
        if p.returncode != 0:
            print(f"{name:11} FAILED: {p.stderr.strip().splitlines()[-1] if p.stderr.strip() else p.returncode}")
            continue
        r = json.loads(p.stdout.strip().splitlines()[-1])
        diff = max(abs(x - c) for x, c in zip(r["losses"], r["cpu_losses"]))
        half = a.steps // 2
        steady = sorted(r["s"][half:])[len(r["s"][half:]) // 2] / sorted(r["cpu_s"][half:])[len(r["cpu_s"][half:]) // 2]
        fb = ", ".join(f"{k.removeprefix('aten::')} {v}" for k, v in r["fallbacks"].items()) or "-"
        print(f"{name:11} {diff:16.2e} {str(r['executions'][half:]):>15} {sum(r['compiles'][half:]):15} "
              f"{steady:14.2f}  {fb}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
