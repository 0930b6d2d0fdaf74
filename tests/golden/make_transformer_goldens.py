#!/usr/bin/python3
"""Golden values for a transformer's layers (torch 1.13, CPU, fp32): LayerNorm, GELU, Embedding and
causal self-attention's core.

transformer_layers.safetensors:
  layernorm.<name>: nn.LayerNorm(C) (eps 1e-5) with random gamma and beta on x (rows, C):
    .x, .gamma, .beta, .y, .dy (a random upstream gradient), .dx, .dgamma, .dbeta (after
    y.backward(dy)); metadata <name>: {"rows", "cols"}.
  gelu.<form>: F.gelu(x, approximate=<form>) for form 'none' and 'tanh' on values from -6 to 6 and
    random ones: .x, .y, .dy, .dx.
  embedding: nn.Embedding(11, 5) on 23 token ids (repeats, one id unused): .ids (int64), .weight, .y,
    .dy, .dweight.
  attention.<name>: nanoGPT's CausalSelfAttention between its Linears (q, k, v split from qkv (B, T,
    3C), heads of D columns, att = softmax(q k^T / sqrt(D)) masked to j <= i, y = att v, heads merged):
    .qkv, .probs (B, H, T, T), .y, .dy, .dqkv; metadata {"batch", "tokens", "heads", "head_dim"}.
transformer_block.safetensors: nanoGPT's Block (ln_1, attn, ln_2, mlp with exact GELU, bias, no
  dropout; C 8, 2 heads) on x (2, 5, 8): init.h.0.<nanoGPT's names>, data.x, data.y, data.dy and
  grad.h.0.<name> after y.backward(dy).
transformer_gpt.safetensors: nanoGPT's GPT (vocab 32, context 8, width 16, 2 layers of 2 heads, bias,
  no dropout, lm_head tied to transformer.wte) on 3 sequences of 6 tokens: init.<state dict names>
  (lm_head.weight left out: it is transformer.wte.weight), data.idx, data.targets (I64), data.logits
  (3, 6, 32), data.loss (F.cross_entropy over the 18 tokens, mean), data.dlogits, grad.<name>.
transformer_gpt_train.safetensors: the tiny GPT (vocab 32, context 16, width 32, 2 layers of 2 heads)
  on 4 sequences of 16 tokens, one torch.optim.SGD(lr 0.5) step, fp32 and under
  torch.autocast("cpu", bfloat16): init.<names>, data.idx, data.targets, <mode>.loss,
  and <mode>.step.<name> (the parameters after the step) for mode fp32 and amp; adamw.step.<name>:
  fp32, one torch.optim.AdamW(lr 1e-2, betas (0.9, 0.95), eps 1e-3) step with nanoGPT's parameter
  groups (weight decay 0.1 on the matrices, 0 on the vectors).

Run with Debian's python3-torch: /usr/bin/python3 tests/golden/make_transformer_goldens.py
"""
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

from make_goldens import encode_safetensors  # the one safetensors writer of the golden scripts

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
from nanogpt import GPT, Block, param_groups  # noqa: E402  the reference model, as the recipe trains it

# name -> (rows, cols): one row, a GPT's (B*T, C) shapes, a row longer than a reduction pass, two values
# a row. (One value a row is left out: torch then gives its own rounding noise times 1/sqrt(eps) where
# the result is exactly beta; the test checks that case itself.)
# name -> (B, T, H, D): one token, nanoGPT's tiny shapes, one head.
ATTENTION_CASES = {"b2t5h2d3": (2, 5, 2, 3), "b1t1h2d4": (1, 1, 2, 4), "b3t16h1d8": (3, 16, 1, 8)}
LAYERNORM_CASES = {"r1c8": (1, 8), "r64c32": (64, 32), "r6c300": (6, 300), "r5c2": (5, 2)}


def goldens():
    torch.set_num_threads(1)
    tensors, meta = {}, {}
    gen = torch.Generator().manual_seed(41)
    for name, (rows, cols) in LAYERNORM_CASES.items():
        ln = torch.nn.LayerNorm(cols)
        with torch.no_grad():
            ln.weight.copy_(torch.rand(cols, generator=gen) + 0.5)
            ln.bias.copy_(torch.randn(cols, generator=gen) * 0.1)
        # An offset and a scale per row, so the statistics are not those of standard normals.
        x = (torch.randn(rows, cols, generator=gen) * 3 + torch.randn(rows, 1, generator=gen) * 5).requires_grad_()
        y = ln(x)
        dy = torch.randn(rows, cols, generator=gen)
        y.backward(dy)
        p = f"layernorm.{name}"
        tensors.update({f"{p}.x": x.detach().clone(), f"{p}.gamma": ln.weight.detach().clone(),
                        f"{p}.beta": ln.bias.detach().clone(), f"{p}.y": y.detach().clone(), f"{p}.dy": dy,
                        f"{p}.dx": x.grad.clone(), f"{p}.dgamma": ln.weight.grad.clone(),
                        f"{p}.dbeta": ln.bias.grad.clone()})
        meta[p] = json.dumps({"rows": rows, "cols": cols})
    for form in ("none", "tanh"):
        x = torch.cat([torch.linspace(-6, 6, 241), torch.randn(259, generator=gen) * 2]).requires_grad_()
        y = F.gelu(x, approximate=form)
        dy = torch.randn(x.shape, generator=gen)
        y.backward(dy)
        p = f"gelu.{form}"
        tensors.update({f"{p}.x": x.detach().clone(), f"{p}.y": y.detach().clone(), f"{p}.dy": dy,
                        f"{p}.dx": x.grad.clone()})
        meta[p] = json.dumps({"form": form})
    emb = torch.nn.Embedding(11, 5)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(11, 5, generator=gen))
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6])  # no 0, no 10
    y = emb(ids)
    dy = torch.randn(y.shape, generator=gen)
    y.backward(dy)
    tensors.update({"embedding.ids": ids, "embedding.weight": emb.weight.detach().clone(),
                    "embedding.y": y.detach().clone(), "embedding.dy": dy,
                    "embedding.dweight": emb.weight.grad.clone()})
    for name, (b, t, h, d) in ATTENTION_CASES.items():
        c = h * d
        qkv = torch.randn(b, t, 3 * c, generator=gen).requires_grad_()
        q, k, v = qkv.split(c, dim=2)
        q = q.view(b, t, h, d).transpose(1, 2)
        k = k.view(b, t, h, d).transpose(1, 2)
        v = v.view(b, t, h, d).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
        att = att.masked_fill(torch.tril(torch.ones(t, t)).view(1, 1, t, t) == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att.retain_grad()
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        dy = torch.randn(y.shape, generator=gen)
        y.backward(dy)
        p = f"attention.{name}"
        tensors.update({f"{p}.qkv": qkv.detach().clone(), f"{p}.probs": att.detach().clone(),
                        f"{p}.y": y.detach().clone(), f"{p}.dy": dy, f"{p}.dqkv": qkv.grad.clone()})
        meta[p] = json.dumps({"batch": b, "tokens": t, "heads": h, "head_dim": d})
    meta["torch"] = torch.__version__
    return tensors, meta


def block_goldens():
    torch.manual_seed(42)
    block = Block(8, 2)
    with torch.no_grad():  # LayerNorm's affine parameters away from 1 and 0
        for ln in (block.ln_1, block.ln_2):
            ln.weight.uniform_(0.5, 1.5)
            ln.bias.normal_(0.0, 0.1)
    tensors = {f"init.h.0.{k}": v.detach().clone() for k, v in block.state_dict().items()}
    x = torch.randn(2, 5, 8)
    y = block(x)
    dy = torch.randn(y.shape)
    y.backward(dy)
    tensors.update({"data.x": x, "data.y": y.detach().clone(), "data.dy": dy})
    tensors.update({f"grad.h.0.{k}": p.grad.clone() for k, p in block.named_parameters()})
    return tensors, {"torch": torch.__version__}


def gpt_goldens():
    torch.manual_seed(43)
    model = GPT(32, 8, 16, 2, 2)
    tensors = {f"init.{k}": v.detach().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    idx = torch.randint(0, 32, (3, 6))
    targets = torch.randint(0, 32, (3, 6))
    logits = model(idx)
    logits.retain_grad()
    loss = F.cross_entropy(logits.view(-1, 32), targets.view(-1))
    loss.backward()
    tensors.update({"data.idx": idx, "data.targets": targets, "data.logits": logits.detach().clone(),
                    "data.loss": loss.detach().clone(), "data.dlogits": logits.grad.clone()})
    tensors.update({f"grad.{k}": p.grad.clone() for k, p in model.named_parameters()})
    return tensors, {"torch": torch.__version__}


# Adam's first step moves each parameter by about lr * sign(grad): a gradient that is rounding noise
# (the key bias's is 0 in exact arithmetic: softmax ignores a constant added to a row) would move by
# lr either way. eps 1e-3 keeps such a step below 1e-6 and the others' (|grad| ~ 1e-3) near lr.
ADAMW = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-3, "weight_decay": 0.1}


def gpt_train_goldens():
    """One SGD step of the issue's tiny GPT on 4 sequences of 16 tokens, fp32 and under bf16 autocast."""
    torch.manual_seed(44)
    vocab, context, width, layers, heads, batch, lr = 32, 16, 32, 2, 2, 4, 0.5
    model = GPT(vocab, context, width, layers, heads)
    init = {k: v.detach().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    tensors = {f"init.{k}": v for k, v in init.items()}
    idx = torch.randint(0, vocab, (batch, context))
    targets = torch.randint(0, vocab, (batch, context))
    tensors.update({"data.idx": idx, "data.targets": targets})
    # SGD in fp32 and under autocast; AdamW with nanoGPT's configure_optimizers groups in fp32.
    steps = (("fp32", False, lambda: torch.optim.SGD(model.parameters(), lr=lr)),
             ("amp", True, lambda: torch.optim.SGD(model.parameters(), lr=lr)),
             ("adamw", False, lambda: torch.optim.AdamW(param_groups(model, ADAMW["weight_decay"]), lr=ADAMW["lr"],
                                                        betas=ADAMW["betas"], eps=ADAMW["eps"])))
    for mode, amp, optimizer in steps:
        model.load_state_dict({**init, "lm_head.weight": init["transformer.wte.weight"]})
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            logits = model(idx)
        loss = F.cross_entropy(logits.float().view(-1, vocab), targets.view(-1))
        loss.backward()
        optimizer().step()
        if mode != "adamw":
            tensors[f"{mode}.loss"] = loss.detach().clone()
        tensors.update({f"{mode}.step.{k}": p.detach().clone() for k, p in model.named_parameters()})
    meta = {"torch": torch.__version__, "vocab": str(vocab), "context": str(context), "width": str(width),
            "layers": str(layers), "heads": str(heads), "batch": str(batch), "lr": str(lr)}
    return tensors, meta


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    for name, make in (("layers", goldens), ("block", block_goldens), ("gpt", gpt_goldens),
                       ("gpt_train", gpt_train_goldens)):
        tensors, meta = make()
        with open(os.path.join(here, f"transformer_{name}.safetensors"), "wb") as f:
            f.write(encode_safetensors(tensors, meta))


if __name__ == "__main__":
    main()
