#!/usr/bin/python3
"""A dp GPT checkpoint in PyTorch: dp_train trains a small GPT on a text, saves it, and evaluates it
(--eval-only); scripts/nanogpt.py loads the file into nanoGPT's GPT with strict=True (lm_head.weight
included, the tied table written under both names) and gets the same held-out loss on the same
windows; nanogpt.py's DDP over two gloo processes trains what one process does. Exit 77 (ctest:
skipped) without torch. Usage: test_gpt_torch.py DP_TRAIN WORK_DIR"""
import os
import re
import subprocess
import sys

try:
    import torch
except ImportError:
    print("skipped: torch is not installed (Debian: python3-torch)")
    sys.exit(77)

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from dp_checkpoint import read  # noqa: E402

MODEL = ["--context", "16", "--layers", "2", "--heads", "2", "--width", "32"]


def main():
    train, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    text = os.path.join(work, "text.txt")
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "runs", "away", "home"]
    with open(text, "w") as f:
        f.write(" ".join(words[(i * 7 + i // 5) % len(words)] for i in range(3000)))
    ckpt = os.path.join(work, "gpt.safetensors")
    subprocess.run([train, "--backend", "sim", "--model", "gpt", *MODEL, "--text", text, "--steps", "30",
                    "--batch-size", "8", "--optimizer", "adamw", "--lr", "3e-3", "--decay", "matrices",
                    "--no-eval", "--save", ckpt], check=True, capture_output=True)
    tensors, _ = read(ckpt)
    assert "lm_head.weight" in tensors, sorted(tensors)
    assert torch.equal(tensors["lm_head.weight"], tensors["transformer.wte.weight"])
    dp = subprocess.run([train, "--backend", "sim", "--model", "gpt", *MODEL, "--text", text, "--eval-only",
                         "--init", ckpt], check=True, capture_output=True, text=True).stdout
    dp_loss = float(re.search(r"test loss ([0-9.]+)", dp).group(1))
    torch_out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "nanogpt.py"), "check", ckpt,
                                "--text", text, *MODEL], check=True, capture_output=True, text=True).stdout
    torch_loss = float(re.search(r"held-out loss ([0-9.]+)", torch_out).group(1))
    print(f"dp {dp_loss:.6f}, torch {torch_loss:.6f}")
    assert abs(dp_loss - torch_loss) <= 2e-6 + 1e-5 * torch_loss, (dp, torch_out)
    assert dp_loss < 4.0, f"30 steps of a 12-word text should learn something: {dp_loss}"

    # nanogpt.py's DDP over two gloo processes trains what one process does: the same global batch,
    # the averaged gradient, so the same losses up to the order of the gradient's sum.
    def torch_losses(*extra):
        out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "nanogpt.py"), "train", "--text", text,
                              *MODEL, "--steps", "6", "--batch-size", "4", "--log-every", "1", "--warmup-steps", "0",
                              "--no-eval", *extra], check=True, capture_output=True, text=True).stdout
        return [float(v) for v in re.findall(r"loss ([0-9.]+)", out)]
    one, two = torch_losses("--threads", "1"), torch_losses("--processes", "2")
    print(f"torch one process {one}, two {two}")
    assert len(one) == len(two) == 6, (one, two)
    assert all(abs(a - b) <= 1e-5 * a for a, b in zip(one, two)), (one, two)
    # A global batch that does not split over the processes: a message and exit 2, before any work.
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "nanogpt.py"), "train", "--text", text,
                          *MODEL, "--steps", "1", "--batch-size", "5", "--processes", "2", "--no-eval"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "--batch-size 5 does not split over --processes 2" in bad.stderr, bad
    assert bad.stdout == "", bad.stdout


if __name__ == "__main__":
    main()
