"""seqpar.trl.SequenceParallelGRPOTrainer with image prompts on a tiny Qwen2.5-VL vs the STOCK trl.GRPOTrainer.

As tests/test_trl_grpo.py: the stock trainer on one process (no SP) in the test process, the seqpar class in a
spawned 2-rank gloo world (SP=2, Ulysses), the same tiny model (saved and loaded by path), prompts, seed and
completions (`_generate_single_turn` replaced in both runs by a deterministic function of the prompt ids; the seqpar
class runs it on each SP rank's share of the rows, with their images, and all-gathers). The prompts are
conversations with an image (TRL's "image" column, a PIL image per row), rendered by a Qwen2.5-VL processor built
offline (the PIL image processor, SmolLM2's tokenizer with Qwen's vision tokens added, a small chat template).
The stock trainer runs the model's own image path on the full rows; the seqpar class the SP forward with the images
encoded once per SP group. One micro-batch per step, SGD lr 0.1, 2 steps, beta 0 and 0.2: per step the gradient
norm (1e-5 relative), the logged losses and every updated parameter (vision tower included) at fp32 1e-5 absolute.
"""

from __future__ import annotations

from unittest import mock

import torch

from seqpar.spawn import run_distributed

TOL = 1e-5
NUM_GEN = 2
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|>"
            "<|vision_end|>{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _processor():
    from transformers import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.processing_utils import ProcessorMixin

    from seqpar.hf import load_smollm2_tokenizer

    class TinyProcessor(Qwen2_5_VLProcessor):  # no video processor: it would need torchvision
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kw):
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.vision_start_token, self.vision_end_token = "<|vision_start|>", "<|vision_end|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)

    tok = load_smollm2_tokenizer()
    # ids 49152.. in the tiny VLM's order: image, video, vision start, vision end
    tok.add_special_tokens({"additional_special_tokens": ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>",
                                                         "<|vision_end|>"]})
    tok.chat_template = TEMPLATE
    ip = Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=64, max_pixels=4096)
    return TinyProcessor(image_processor=ip, tokenizer=tok, chat_template=TEMPLATE)


def images_and_texts() -> list[tuple]:
    """8 (PIL image of one of four sizes, prompt text) pairs, the same on every call (also tests/*_stacks.py)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    words = "the cat sat on a mat while dogs ran far".split()
    out = []
    for i in range(8):
        h, w = [(16, 24), (16, 16), (24, 16), (16, 32)][i % 4]
        img = Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8"))
        out.append((img, " ".join(rng.choice(words, 3 + i % 4))))
    return out


def _dataset():
    import datasets

    return datasets.Dataset.from_list([
        {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}], "image": img}
        for img, text in images_and_texts()])


def reward_chars(completions, **kwargs):
    return [float(sum(map(ord, str(c))) % 7) for c in completions]


def _fake_generate(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
    seen: dict[tuple, int] = {}
    out = []
    for ids in prompt_ids:
        k = seen[tuple(ids)] = seen.get(tuple(ids), -1) + 1
        n = 3 + (sum(ids) + 3 * k) % 6
        out.append([100 + (sum(ids) * 31 + 17 * k + 7 * t) % 5000 for t in range(n)])
    return out, None


def _train(beta: float, model_dir: str, out: str, sp: int | None):
    import trl
    from transformers import AutoModelForImageTextToText

    import seqpar.trl as strl

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    args = trl.GRPOConfig(output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=1, max_steps=2,
                          num_generations=NUM_GEN, max_completion_length=8, logging_steps=1, report_to=[],
                          save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, bf16=False, optim="sgd",
                          learning_rate=0.1, max_grad_norm=1.0, beta=beta, loss_type="grpo",
                          gradient_checkpointing=False)
    cls = trl.GRPOTrainer if sp is None else strl.SequenceParallelGRPOTrainer
    kw = {} if sp is None else {"sequence_parallel_size": sp}
    trainer = cls(model=model, reward_funcs=reward_chars, args=args, train_dataset=_dataset(),
                  processing_class=_processor(), **kw)
    # the stock run is in the test process: put TRL's generation back afterwards (later tests sample for real)
    with mock.patch.object(trl.GRPOTrainer, "_generate_single_turn", _fake_generate):
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    gnorms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    params = {k.replace("module.", ""): v.detach().clone() for k, v in trainer.model.named_parameters()}
    return losses, params, gnorms


def _sp_world(betas, model_dir: str, refs: str, out: str) -> list[dict]:
    ref = torch.load(refs)
    res = []
    for i, beta in enumerate(betas):
        losses, params, gnorms = _train(beta, model_dir, f"{out}/{i}", 2)
        ref_losses, ref_params, ref_gnorms = ref[i]
        res.append({"beta": beta, "losses": losses, "ref_losses": ref_losses,
                    "dgnorm": max(abs(a - b) / b for a, b in zip(gnorms, ref_gnorms)),
                    "dloss": max(abs(a - b) for a, b in zip(losses, ref_losses)),
                    "dparam": max(float((params[k] - v).abs().max()) for k, v in ref_params.items()),
                    "vision_moved": max(float((params[k] - v).abs().max()) for k, v in ref[-1].items()
                                        if "visual" in k)})
    return res


def test_grpo_image_prompts_sp2_match_stock_trl(tmp_path):
    from transformers import AutoModelForImageTextToText

    from seqpar.hf import tiny_model

    model_dir = str(tmp_path / "tiny")
    tiny_model("qwen2_5_vl", 4, 2, vocab_size=49152, seed=0).save_pretrained(model_dir)
    init = dict(AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).named_parameters())
    betas = [0.0, 0.2]
    refs = [_train(b, model_dir, str(tmp_path / f"ref{i}"), None) for i, b in enumerate(betas)]
    torch.save([*refs, {k: v.detach() for k, v in init.items()}], tmp_path / "refs.pt")
    results = run_distributed(_sp_world, 2, betas, model_dir, str(tmp_path / "refs.pt"), str(tmp_path / "sp"),
                              timeout=600)
    for r in results[0]:
        print(r)
        assert len(r["losses"]) == len(r["ref_losses"]) == 2, r
        assert r["dgnorm"] <= TOL and r["dloss"] <= TOL and r["dparam"] <= TOL, r
        assert r["vision_moved"] > 1e-4, r  # the images reached the loss: the tower trained
