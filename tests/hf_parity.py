#!/usr/bin/env python3
"""Parity with Hugging Face transformers (LlamaForCausalLM, the most used Llama there is, and
Qwen3ForCausalLM).

For a tied and an untied Llama test model (GQA, llama3 RoPE scaling) and a Qwen3 one (per-head
norms of q and k, query heads x head dim wider than the hidden size), from the repository root:
  1. build a random model of its family, save it (safetensors), write S + 1 tokens as a token file;
  2. run ./train from that checkpoint on those tokens for one step: --dump gives our loss and
     every gradient (bf16 compute), --save-to our weights after one AdamW step (fp32);
  3. compute the same in PyTorch in float32: loss, gradients, one AdamW step with the same
     hyperparameters (decay on matrices, global-norm clipping), and compare; and torch's AdamW
     given our gradients must move every weight as our step did;
  4. round trip: our --save-to of the untouched weights loads in transformers and gives the
     original model's logits on a prompt (exactly in fp32; within bf16 rounding in bf16), and
     loaded with the dtype its config.json names ("auto") each save comes back in the dtype saved.
Then a packed-documents case on the tiny model: a version-2 token file of documents (one of a
single token, boundaries on the 64- and 128-token tiles, one starting at SEQ), one step of
./train --doc-mask, against transformers given the same documents: a block-diagonal causal 4D
mask, RoPE positions restarting at each document, and each document's last target (the next
one's first token) not scored; the loss and every gradient, with step 3's tolerances.
Exits 0 when everything agrees, 1 otherwise; prints SKIPPED and exits 0 without a GPU, PyTorch
or transformers.
"""
import math
import os
import struct
import subprocess
import sys
import tempfile

try:
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
except ImportError as e:
    print(f"SKIPPED: needs torch and transformers ({e})")
    sys.exit(0)
if not torch.cuda.is_available():
    print("SKIPPED: no GPU")
    sys.exit(0)

# Our test models (infra/common.h), as transformers configs.
MODELS = {
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 intermediate_size=384, vocab_size=512, tie_word_embeddings=True,
                 rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                   original_max_position_embeddings=64)),
    "tiny-untied": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=64,
                        intermediate_size=320, vocab_size=384, tie_word_embeddings=False,
                        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                          original_max_position_embeddings=64)),
    "tiny-qwen3": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                       intermediate_size=256, vocab_size=384, tie_word_embeddings=False),
}
# Each model's family: its transformers classes, and what its config adds (eps, RoPE theta).
FAMILY = {"tiny-qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(rms_norm_eps=1e-6, rope_theta=1e6))}
LLAMA = (LlamaConfig, LlamaForCausalLM, dict(rms_norm_eps=1e-5, rope_theta=500000.0, mlp_bias=False))


def model_class(name):
    return FAMILY.get(name, LLAMA)[1]
SEQ, LR, WD, CLIP = 256, 1e-3, 0.1, 1.0
# The packed case: its model, and its token file's document starts (SEQ + 1 tokens, all < SEQ + 1):
# a 37-token document; documents ending on the 64- and 128-token tile boundaries; one of a single
# token (100); and one starting at SEQ, past the window's tokens, whose first token is only the
# window's last target (not scored).
PACKED_MODEL, PACKED_STARTS = "tiny", [0, 37, 64, 100, 101, 128, 190, SEQ]


def our_layout(c):
    """Offsets of our flat parameter array (infra/common.h param_layout) and the HF pieces of each tensor:
    Qwen3's q_norm and k_norm after the fused q|k|v."""
    D, F_, V, qd, kvd = c.hidden_size, c.intermediate_size, c.vocab_size, c.num_attention_heads * c.head_dim, \
        c.num_key_value_heads * c.head_dim
    off, out = 0, []

    def add(pieces, rows, cols):
        nonlocal off
        out.append((off, rows, cols, pieces))
        off = (off + rows * cols + 127) // 128 * 128

    add([("model.embed_tokens.weight", 0)], V, D)
    for l in range(c.num_hidden_layers):
        p = f"model.layers.{l}."
        add([(p + "input_layernorm.weight", 0)], 1, D)
        add([(p + "self_attn.q_proj.weight", 0), (p + "self_attn.k_proj.weight", qd),
             (p + "self_attn.v_proj.weight", qd + kvd)], qd + 2 * kvd, D)
        if c.model_type == "qwen3":
            add([(p + "self_attn.q_norm.weight", 0)], 1, c.head_dim)
            add([(p + "self_attn.k_norm.weight", 0)], 1, c.head_dim)
        add([(p + "self_attn.o_proj.weight", 0)], D, qd)
        add([(p + "post_attention_layernorm.weight", 0)], 1, D)
        add([(p + "mlp.gate_proj.weight", 0), (p + "mlp.up_proj.weight", F_)], 2 * F_, D)
        add([(p + "mlp.down_proj.weight", 0)], D, F_)
    add([("model.norm.weight", 0)], 1, D)
    if not c.tie_word_embeddings:
        add([("lm_head.weight", 0)], V, D)
    return out, off


def read_dump(path):
    with open(path, "rb") as f:
        assert f.read(8) == b"LLGRAD01", "not a --dump file"
        loss, = struct.unpack("<d", f.read(8))
        n, = struct.unpack("<q", f.read(8))
        g = torch.frombuffer(bytearray(f.read(4 * n)), dtype=torch.float32)
    return loss, g


def write_tokens(path, ids):
    with open(path, "wb") as f:
        f.write(b"LLTOKENS" + struct.pack("<IIQ", 1, 4, len(ids)))
        f.write(struct.pack(f"<{len(ids)}I", *ids))


def write_documents(path, ids, starts):
    """A version-2 token file (README): the header with the document count, the tokens as uint32,
    then each document's start as uint64 (ascending, the first 0, each < the token count)."""
    assert starts[0] == 0 and starts == sorted(set(starts)) and starts[-1] < len(ids)
    with open(path, "wb") as f:
        f.write(b"LLTOKENS" + struct.pack("<IIQQ", 2, 4, len(ids), len(starts)))
        f.write(struct.pack(f"<{len(ids)}I", *ids))
        f.write(struct.pack(f"<{len(starts)}Q", *starts))


def run(cmd):
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        print(r.stdout)
        raise SystemExit(f"FAILED: {' '.join(cmd)} exited with {r.returncode}")
    return r.stdout


def cos(a, b):
    return float(torch.dot(a, b) / (a.norm() * b.norm() + 1e-30))


def new_model(name):
    """The random model of a test model's family (the same weights every call), fp32, on the GPU;
    eager attention, which adds a 4D attention mask as given (the packed case's). Qwen3's norm
    gains are drawn around 1, so that a gain applied in the wrong place shows."""
    torch.manual_seed(1234)
    config_class, model_cls, extra = FAMILY.get(name, LLAMA)
    cfg = config_class(**MODELS[name], **extra, max_position_embeddings=131072, hidden_act="silu",
                       attention_bias=False, initializer_range=0.05)
    cfg._attn_implementation = "eager"
    model = model_cls(cfg).float().cuda()
    if name in FAMILY:
        with torch.no_grad():
            for k, v in model.named_parameters():
                if k.endswith("norm.weight"):
                    v.add_(0.2 * torch.randn_like(v))
    return cfg, model


def packed_inputs(ids, starts):
    """What ./train --doc-mask makes of the one window (offset 0) of a token file with these
    document starts: for its SEQ tokens, the RoPE positions (index - its document's start) and
    the additive 4D attention mask [1, 1, SEQ, SEQ] (0 where a query may see a key: earlier or the
    same token of its own document; the dtype's min elsewhere); and the targets tokens[1:SEQ+1],
    -100 (ignored) at each document's last token before a document that starts at 1 .. SEQ."""
    index = torch.arange(SEQ)
    inside = torch.tensor([s for s in starts if s < SEQ])  # the documents of the window's tokens
    doc = torch.searchsorted(inside, index, right=True) - 1  # each token's document
    positions = index - inside[doc]
    allowed = (doc[:, None] == doc[None, :]) & (index[None, :] <= index[:, None])
    mask = torch.zeros(SEQ, SEQ).masked_fill(~allowed, torch.finfo(torch.float32).min)
    y = torch.tensor(ids[1:SEQ + 1])
    for s in starts:
        if 0 < s <= SEQ:
            y[s - 1] = -100
    return positions[None].cuda(), mask[None, None].cuda(), y.cuda()


def packed_case(rows):
    """./train --doc-mask against transformers on packed documents: loss and every gradient.
    Appends its lines to rows; returns whether everything agrees."""
    name = PACKED_MODEL
    cfg, model = new_model(name)
    tmp = tempfile.mkdtemp(prefix=f"hf_parity_packed_{name}_")
    model.save_pretrained(f"{tmp}/hf", safe_serialization=True)
    ids = torch.randint(0, cfg.vocab_size, (SEQ + 1,)).tolist()
    write_documents(f"{tmp}/tokens.bin", ids, PACKED_STARTS)

    # Ours: the unpacked case's step, with --doc-mask (the file holds one window: offset 0).
    run(["./train", "--config", name, "--init-from", f"{tmp}/hf", "--data", f"{tmp}/tokens.bin",
         "--seq-len", str(SEQ), "--steps", "1", "--lr", str(LR), "--warmup", "0", "--weight-decay", str(WD),
         "--grad-clip", str(CLIP), "--dump", f"{tmp}/grads.bin", "--save-to", f"{tmp}/ours", "--save-dtype", "fp32",
         "--doc-mask"])
    our_loss, our_grads = read_dump(f"{tmp}/grads.bin")

    # transformers, float32, given the documents: the mean loss over the scored targets.
    positions, mask, y = packed_inputs(ids, PACKED_STARTS)
    x = torch.tensor(ids[:SEQ], device="cuda")[None]
    logits = model(x, attention_mask=mask, position_ids=positions, use_cache=False).logits[0].float()
    loss = F.cross_entropy(logits, y, ignore_index=-100)
    loss.backward()
    grads = {k: v.grad.detach().clone() for k, v in model.named_parameters()}

    loss_err = abs(our_loss - loss.item()) / loss.item()
    ok = loss_err < 1e-2
    n_docs, scored = sum(s < SEQ for s in PACKED_STARTS), int((y >= 0).sum())
    rows.append(f"{name + ' packed':12} loss   ours {our_loss:.6f}  transformers {loss.item():.6f}  rel error "
                f"{loss_err:.2e} ({n_docs} documents, {scored} of {SEQ} targets scored, --doc-mask)")
    layout, total = our_layout(cfg)
    assert total == our_grads.numel(), f"layout mismatch: {total} vs {our_grads.numel()}"
    worst_cos = 1.0
    for off, r, cols, pieces in layout:
        ref = torch.cat([grads[p].flatten().cpu() for p, _ in pieces])
        c = cos(our_grads[off:off + r * cols], ref)
        worst_cos = min(worst_cos, c)
        if c <= 0.99:
            ok = False
            rows.append(f"   packed gradient {pieces[0][0]}: cosine {c:.5f}")
    rows.append(f"{name + ' packed':12} every gradient tensor: min cosine {worst_cos:.5f} (needs > 0.99)")
    return ok


def main():
    ok = True
    rows = []
    for name in MODELS:
        cfg, model = new_model(name)
        Model = model_class(name)
        tmp = tempfile.mkdtemp(prefix=f"hf_parity_{name}_")
        model.save_pretrained(f"{tmp}/hf", safe_serialization=True)
        ids = torch.randint(0, cfg.vocab_size, (SEQ + 1,)).tolist()
        write_tokens(f"{tmp}/tokens.bin", ids)

        # Ours: one step from the checkpoint on exactly these tokens (the file holds one window).
        run(["./train", "--config", name, "--init-from", f"{tmp}/hf", "--data", f"{tmp}/tokens.bin",
             "--seq-len", str(SEQ), "--steps", "1", "--lr", str(LR), "--warmup", "0", "--weight-decay", str(WD),
             "--grad-clip", str(CLIP), "--dump", f"{tmp}/grads.bin", "--save-to", f"{tmp}/ours", "--save-dtype", "fp32"])
        our_loss, our_grads = read_dump(f"{tmp}/grads.bin")

        # transformers, float32: loss, gradients, one AdamW step.
        x = torch.tensor(ids[:-1], device="cuda")[None]
        y = torch.tensor(ids[1:], device="cuda")
        before = {k: v.detach().clone() for k, v in model.named_parameters()}
        loss = F.cross_entropy(model(x).logits[0].float(), y)
        loss.backward()
        grads = {k: v.grad.detach().clone() for k, v in model.named_parameters()}
        decay = [p for k, p in model.named_parameters() if p.dim() >= 2]
        no_decay = [p for k, p in model.named_parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=LR, betas=(0.9, 0.95), eps=1e-8)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        after = {k: v.detach().clone() for k, v in model.named_parameters()}
        ours_after = Model.from_pretrained(f"{tmp}/ours", torch_dtype=torch.float32).cuda()
        ours_after = dict(ours_after.named_parameters())

        loss_err = abs(our_loss - loss.item()) / loss.item()
        ok &= loss_err < 1e-2
        rows.append(f"{name:12} loss   ours {our_loss:.6f}  transformers {loss.item():.6f}  rel error {loss_err:.2e}")
        layout, total = our_layout(cfg)
        assert total == our_grads.numel(), f"layout mismatch: {total} vs {our_grads.numel()}"
        worst_cos, worst_upd, worst_gain, worst_opt = 1.0, 1.0, 1.0, 1.0
        for off, r, cols, pieces in layout:
            ref = torch.cat([grads[p].flatten().cpu() for p, _ in pieces])
            got = our_grads[off:off + r * cols]
            c = cos(got, ref)
            worst_cos = min(worst_cos, c)
            if c <= 0.99:
                ok = False
                rows.append(f"   gradient {pieces[0][0]}: cosine {c:.5f}")
            for p, _ in pieces:  # the optimizer step: our update against transformers'
                du = (ours_after[p].detach() - before[p]).flatten().cpu()
                dh = (after[p] - before[p]).flatten().cpu()
                cu = cos(du, dh)
                # Adam's first step moves each weight by about lr times its gradient's sign, so a
                # gain vector's few near-zero gradients flip with rounding and move its cosine by
                # 2/length each: gains are held to the exact check below instead.
                if r == 1:
                    worst_gain = min(worst_gain, cu)
                    continue
                worst_upd = min(worst_upd, cu)
                if cu <= 0.95:
                    ok = False
                    rows.append(f"   AdamW update of {p}: cosine {cu:.5f}")
        # torch's AdamW given our gradients (--dump) must move every weight as ours did: the
        # optimizer itself, exactly, whatever the gradients' rounding.
        mine = Model.from_pretrained(f"{tmp}/hf", torch_dtype=torch.float32).cuda()
        params = dict(mine.named_parameters())
        for off, r, cols, pieces in layout:
            for p, row0 in pieces:
                t = params[p]
                t.grad = our_grads[off + row0 * cols:off + row0 * cols + t.numel()].view_as(t).clone().cuda()
        opt = torch.optim.AdamW([{"params": [t for t in params.values() if t.dim() >= 2], "weight_decay": WD},
                                 {"params": [t for t in params.values() if t.dim() < 2], "weight_decay": 0.0}],
                                lr=LR, betas=(0.9, 0.95), eps=1e-8)
        torch.nn.utils.clip_grad_norm_(mine.parameters(), CLIP)
        opt.step()
        for p, t in params.items():
            co = cos((ours_after[p].detach() - before[p]).flatten().cpu(), (t.detach() - before[p]).flatten().cpu())
            worst_opt = min(worst_opt, co)
            if co <= 0.9999:
                ok = False
                rows.append(f"   AdamW update of {p} against torch's on our gradients: cosine {co:.6f}")
        rows.append(f"{name:12} every gradient tensor: min cosine {worst_cos:.5f} (needs > 0.99); "
                    f"every AdamW update of a matrix: min cosine {worst_upd:.5f} (needs > 0.95; norm gains "
                    f"{worst_gain:.5f}); torch's AdamW on our gradients: min cosine {worst_opt:.6f} (needs > 0.9999)")

        # Round trip: our save of the untouched weights, loaded by transformers.
        run(["./train", "--config", name, "--init-from", f"{tmp}/hf", "--steps", "0", "--save-to", f"{tmp}/rt32",
             "--save-dtype", "fp32"])
        run(["./train", "--config", name, "--init-from", f"{tmp}/hf", "--steps", "0", "--save-to", f"{tmp}/rt16"])
        prompt = torch.tensor(ids[:64], device="cuda")[None]
        orig = Model.from_pretrained(f"{tmp}/hf", torch_dtype=torch.float32).cuda()
        with torch.no_grad():
            want = orig(prompt).logits.float()
            got32 = Model.from_pretrained(f"{tmp}/rt32", torch_dtype=torch.float32).cuda()(prompt).logits.float()
            got16 = Model.from_pretrained(f"{tmp}/rt16", torch_dtype=torch.float32).cuda()(prompt).logits.float()
        e32 = float((got32 - want).norm() / want.norm())
        e16 = float((got16 - want).norm() / want.norm())
        ok &= e32 < 1e-6 and e16 < 1e-2
        rows.append(f"{name:12} our saved checkpoint in transformers: logits rel error fp32 {e32:.2e} (needs < 1e-6), "
                    f"bf16 {e16:.2e} (needs < 1e-2)")
        auto = {d: next(Model.from_pretrained(f"{tmp}/{d}", torch_dtype="auto").parameters()).dtype
                for d in ("rt32", "rt16")}
        ok &= auto == {"rt32": torch.float32, "rt16": torch.bfloat16}
        rows.append(f"{name:12} loaded with the dtype config.json names: fp32 save {auto['rt32']}, "
                    f"bf16 save {auto['rt16']} (needs torch.float32, torch.bfloat16)")
    ok &= packed_case(rows)
    print("\n".join(rows))
    print("PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
