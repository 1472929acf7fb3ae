"""A dense test oracle of DeepSeek-V4.1's backbone (V41-REFERENCE §3-4), over whole sequences, in fp64.

No public implementation of V4.1 can be called here (transformers has none), so this writes the equations
out once, plainly, for the graph's V4.1 reference to be checked against when it exists: every token of a
sequence from position 0, no cache; each layer's attention reads the window of the last sliding_window
positions and the compressed entries its KV source made, chosen by the latest index source's top-k (the
candidate source's blocks restricting the reindex layers); the shifted mHC collapses each sub-layer's input
with the previous sub-layer's pre; Engram adds its gated rows before its layers; the last FFN's pre collapses
the streams for the head. The caches' low-precision simulation is applied where §3.9 puts it. Weights are
decoded from the checkpoint's stored format to fp32 (FP8 blocks, FP4 experts) by the project's decoders.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import tokenizers
import torch

from backends.cpu.ops import attention as attention_ops, basic, hc, moe, rope as rope_ops
from backends.cpu.ops.candidates import candidate_mask, reindex_scores
from backends.cpu.ops.engram import engram_inject, engram_rows
from backends.cpu.ops.latent_entries import latent_entries
from lib.engram.hashing import hash_params, hash_ids
from lib.engram.token_map import build_token_map
from lib.quant.kv_simulation import fp4_index, fp8_window
from lib.quant.reference_formats import decode
from lib.runtime.rope_tables import inv_freq
from lib.text.tokenizer import Tokenizer
from lib.weights.checkpoint import Checkpoint
from spec.schedule import backbone, drafter

F64 = torch.float64


class V41Oracle:
    def __init__(self, path: Path | str):
        self.ckpt = Checkpoint(path)
        cfg = self.cfg = self.ckpt.config
        self.w: dict[str, torch.Tensor] = {}
        for t in self.ckpt.logical:
            stored = self.ckpt.read_parts(t)
            self.w[t.key] = decode(t.format, stored, cfg).to(F64) if t.format != "fp8_row32" else stored
        self.layers, self.stages = backbone(cfg), drafter(cfg)
        self.tables = {name: inv_freq(cfg, name) for name in ("main", "compress")}
        tok = Tokenizer(tokenizers.Tokenizer.from_file(str(Path(path) / "tokenizer.json")))
        self.token_map = build_token_map(tok, cfg.engram_pad_token_id, cfg.engram_compressed_vocab_size)
        self.hashing = hash_params(cfg, self.token_map.pad)

    # ---- pieces ------------------------------------------------------------------------------------
    def angles(self, table: str, positions: torch.Tensor):
        a = positions.double()[:, None] * self.tables[table].double()[None, :]
        return a.cos(), a.sin()

    def norm(self, x, key):
        return basic.rms_norm(x, self.w[key], self.cfg.rms_norm_eps).to(F64)

    def coefficients(self, x, prefix: str, part: str):
        """(pre, post, comb) of a sub-layer from its own input streams x [T, n, D] (§3.1): V4's equations."""
        cfg = self.cfg
        return hc.hc_coefficients(x, self.w[f"{prefix}.hc_{part}_fn"], self.w[f"{prefix}.hc_{part}_base"],
                                  self.w[f"{prefix}.hc_{part}_scale"], cfg.hc_sinkhorn_iters, cfg.rms_norm_eps,
                                  cfg.hc_eps)

    def moe(self, x, prefix: str, topk: int | None = None):
        """§3.11, V4's learned routing and clipped SwiGLU (gate_temp 1, the reference's default; not a config key)."""
        cfg = self.cfg
        weights, ids = moe.route_learned(x, self.w[f"{prefix}.ffn.gate.weight"], self.w[f"{prefix}.ffn.gate.bias"],
                                         topk or cfg.num_experts_per_tok, cfg.routed_scaling_factor)

        def expert(h, name):
            return moe.swiglu_mlp(h, *(self.w[f"{name}.{k}.weight"] for k in ("w1", "w3", "w2")), cfg.swiglu_limit)

        out = expert(x, f"{prefix}.ffn.shared_experts").to(F64)
        for t in range(x.shape[0]):
            for slot in range(ids.shape[1]):
                out[t] += weights[t, slot] * expert(x[t:t + 1], f"{prefix}.ffn.experts.{int(ids[t, slot])}")[0]
        return out

    def query(self, h, prefix: str, cos, sin):
        """(qr, q [T, H, D]): the q latent and the rotated query, with no per-head q norm (§3.2)."""
        cfg = self.cfg
        qr = self.norm(h @ self.w[f"{prefix}.attn.wq_a.weight"].t(), f"{prefix}.attn.q_norm.weight")
        q = (qr @ self.w[f"{prefix}.attn.wq_b.weight"].t()).view(h.shape[0], cfg.num_attention_heads, cfg.head_dim)
        return qr, rope_ops.rope(q, (cos, sin), cfg.qk_rope_head_dim).to(F64)

    def window_kv(self, h, prefix: str, cos, sin):
        """A layer's (or stage's) window rows: FP8(RoPE(kv_norm(W_kv h))) (§3.3)."""
        kv = self.norm(h @ self.w[f"{prefix}.attn.wkv.weight"].t(), f"{prefix}.attn.kv_norm.weight")
        return fp8_window(rope_ops.rope(kv, (cos, sin), self.cfg.qk_rope_head_dim)).to(F64)

    def attend(self, q, keys, prefix: str):
        """q [H, D] over keys [N, D] (K = V, §3.8), the sink in the denominator: -> [H, D]."""
        logits = torch.einsum("hd,nd->hn", q, keys)[None] / math.sqrt(self.cfg.head_dim)
        return (attention_ops._softmax_with_sink(logits, self.w[f"{prefix}.attn.attn_sink"])[0] @ keys).to(F64)

    def output(self, out, prefix: str, cos, sin):
        """Inverse RoPE on the attention output, then the grouped wo_a and wo_b."""
        cfg = self.cfg
        o = rope_ops.rope(out, (cos, sin), cfg.qk_rope_head_dim, inverse=True).to(F64)
        z = basic.grouped_linear(o, self.w[f"{prefix}.attn.wo_a.weight"], cfg.o_groups).to(F64)
        return basic.o_proj(z, self.w[f"{prefix}.attn.wo_b.weight"], cfg.o_groups).to(F64)

    # ---- attention ------------------------------------------------------------------------------------
    def attention(self, h, layer, shared: dict):
        cfg, p, t = self.cfg, layer.prefix, h.shape[0]
        pos = torch.arange(t)
        cos, sin = self.angles(layer.rope, pos)
        qr, q = self.query(h, p, cos, sin)
        kv = self.window_kv(h, p, cos, sin)
        r = layer.ratio
        if layer.kv_source:                                      # §3.4-3.6: this layer's entries and index keys
            k_all = h @ self.w[f"{p}.attn.compressor.wkv.weight"].t()
            groups = t // r
            if r > 1:
                g_all = h @ self.w[f"{p}.attn.compressor.wgate.weight"].t()
                k_g, g_g = (v[: groups * r].view(groups, r, v.shape[-1]) for v in (k_all, g_all))
                pooled = (torch.softmax(g_g, dim=1) * k_g).sum(1)
            else:
                pooled = k_all
            ecos, esin = self.angles(layer.rope, torch.arange(groups) * r)
            main, keys = latent_entries(pooled, self.w[f"{p}.attn.compressor.norm.weight"],
                                        self.w[f"{p}.attn.indexer.wk.weight"], self.w[f"{p}.attn.indexer.k_norm.weight"],
                                        (ecos, esin), cfg.qk_rope_head_dim, cfg.rms_norm_eps)
            shared.update(entries=main.to(F64), keys=keys.to(F64), ratio=r)
        visible = (pos + 1) // r if r else torch.zeros(t, dtype=torch.int64)
        if layer.index_source:                                   # §3.6-3.7: this layer's top-k of the entries
            iq = (qr @ self.w[f"{p}.attn.indexer.wq_b.weight"].t()).view(t, cfg.index_n_heads, cfg.index_head_dim)
            iq = fp4_index(rope_ops.rope(iq, (cos, sin), cfg.qk_rope_head_dim)).to(F64)
            iw = (h @ self.w[f"{p}.attn.indexer.weights_proj.weight"].t()) * (cfg.index_head_dim * cfg.index_n_heads) ** -0.5
            scores = (iw[:, :, None] * torch.relu(torch.einsum("thd,nd->thn", iq, shared["keys"]))).sum(1)
            scores = scores.masked_fill(torch.arange(scores.shape[1])[None, :] >= visible[:, None], -math.inf)
            if layer.candidate_source:
                shared["candidates"] = candidate_mask(scores, visible, cfg.candidate_block_size, cfg.candidate_topk_blocks)
            elif "candidates" in shared:
                scores = reindex_scores(scores, shared["candidates"])
            k = min(cfg.index_topk, scores.shape[1])
            top = torch.topk(scores, k, dim=-1)
            shared["selection"] = torch.where(torch.isfinite(top.values), top.indices, -1) if k else top.indices
        out = torch.empty(t, cfg.num_attention_heads, cfg.head_dim, dtype=F64)
        for i in range(t):
            rows = [kv[max(0, i - cfg.sliding_window + 1): i + 1]]
            if r:
                picked = shared["selection"][i]
                rows.append(shared["entries"][picked[picked >= 0]])
            out[i] = self.attend(q[i], torch.cat(rows), p)
        return self.output(out, p, cos, sin)

    # ---- the backbone -----------------------------------------------------------------------------------
    def engram(self, x, layer, tokens: list[int]):
        cfg, p = self.cfg, layer.prefix
        ids = hash_ids(self.token_map.compress(tokens), self.hashing)              # [T, layers, columns]
        slot = list(cfg.engram_layer_ids).index(layer.index)                         # which Engram layer
        rows = engram_rows(torch.from_numpy(np.ascontiguousarray(ids[:, slot])),
                           self.w[f"{p}.engram.embed.weight"]["weight"], self.w[f"{p}.engram.embed.weight"]["scale"])
        return engram_inject(x, rows, self.w[f"{p}.engram.wkv.weight"], self.w[f"{p}.engram.q_weight"],
                             self.w[f"{p}.engram.k_weight"], cfg.rms_norm_eps).to(F64)

    def logits(self, tokens: list[int]) -> torch.Tensor:
        """[T, vocab] fp64 logits of every position of `tokens` (a sequence from position 0)."""
        return self.forward(tokens)[0]

    def forward(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [T, vocab], main_hidden [T, taps * D]: the stream mean at the input of each DSpark target layer)."""
        cfg, n = self.cfg, self.cfg.hc_mult
        taps = []
        e = self.w["embed.weight"][torch.tensor(tokens)]
        x = e[:, None, :].expand(-1, n, -1).clone()
        pi = torch.zeros(len(tokens), n, dtype=F64)
        pi[:, 0] = 1.0                                           # layer 0 collapses with a one-hot (§3.1)
        shared: dict = {}
        for layer in self.layers:
            p = layer.prefix
            if layer.index in cfg.dspark_target_layer_ids:      # the input of the layer, not its output (§5)
                taps.append(x.mean(1))
            if layer.engram:
                x = self.engram(x, layer, tokens)
            pre_a, post_a, comb_a = self.coefficients(x, p, "attn")
            h = self.norm((pi[:, :, None] * x).sum(1), f"{p}.attn_norm.weight")
            a = self.attention(h, layer, shared)
            x = hc.hc_post(a, x, post_a, comb_a).to(F64)
            pre_f, post_f, comb_f = self.coefficients(x, p, "ffn")
            f = self.moe(self.norm((pre_a[:, :, None] * x).sum(1), f"{p}.ffn_norm.weight"), p)
            x = hc.hc_post(f, x, post_f, comb_f).to(F64)
            pi = pre_f
        y = self.norm((pi[:, :, None] * x).sum(1), "norm.weight")                   # no hc_head (§3.1)
        return y @ self.w["head.weight"].t(), torch.cat(taps, dim=-1)

    # ---- the DSpark drafter (§5) ----------------------------------------------------------------------
    def stage_attention(self, h, prefix: str, positions: torch.Tensor, ring: torch.Tensor):
        """Every block row attends every ring row and all block rows (bidirectional within the block)."""
        cos, sin = self.angles("main", positions)
        _, q = self.query(h, prefix, cos, sin)
        keys = torch.cat((ring, self.window_kv(h, prefix, cos, sin)))
        out = torch.stack([self.attend(q[i], keys, prefix) for i in range(h.shape[0])])
        return self.output(out, prefix, cos, sin)

    def draft(self, tokens: list[int]):
        """One greedy DSpark round after the prompt `tokens`: the target's token b at position P + 1 (P the last
        position), then the block [b, noise x (block - 1)] at P + 1 .. P + block through every stage. Returns
        (b, drafts [block] (each y_{j+1} = argmax of base_j + the Markov bias of y_j), base logits [block, vocab],
        confidences [block])."""
        cfg, n, size = self.cfg, self.cfg.hc_mult, self.cfg.dspark_block_size
        logits, hidden = self.forward(tokens)
        b = int(logits[-1].argmax())
        first, last = self.stages[0].prefix, self.stages[-1].prefix
        main_x = self.norm(hidden @ self.w[f"{first}.main_proj.weight"].t(), f"{first}.main_norm.weight")
        context = torch.arange(len(tokens))[-cfg.sliding_window:]                  # the ring keeps the last window
        positions = len(tokens) + torch.arange(size)
        ids = torch.tensor([b] + [cfg.dspark_noise_token_id] * (size - 1))
        x = self.w["embed.weight"][ids][:, None, :].expand(-1, n, -1).clone()
        pi = torch.zeros(size, n, dtype=F64)
        pi[:, 0] = 1.0                                           # the first stage collapses with a one-hot
        for stage in self.stages:
            p = stage.prefix
            ring = self.window_kv(main_x[context], p, *self.angles("main", context))
            pre_a, post_a, comb_a = self.coefficients(x, p, "attn")
            a = self.stage_attention(self.norm((pi[:, :, None] * x).sum(1), f"{p}.attn_norm.weight"), p, positions, ring)
            x = hc.hc_post(a, x, post_a, comb_a).to(F64)
            pre_f, post_f, comb_f = self.coefficients(x, p, "ffn")
            f = self.moe(self.norm((pre_a[:, :, None] * x).sum(1), f"{p}.ffn_norm.weight"), p,
                         cfg.dspark_num_experts_per_tok)
            x = hc.hc_post(f, x, post_f, comb_f).to(F64)
            pi = pre_f
        state = (pi[:, :, None] * x).sum(1)                                          # un-normed, for the confidence
        base = self.norm(state, f"{last}.norm.weight") @ self.w["head.weight"].t()
        embed, bias = self.w[f"{last}.markov_head.embed.weight"], self.w[f"{last}.markov_head.head.weight"]
        drafts, confidence, y = [], [], b
        for j in range(size):
            e = embed[y]
            step = base[j] + bias @ e
            confidence.append(float(self.w[f"{last}.confidence_head.proj.weight"][0] @ torch.cat((state[j], e))))
            y = int(step.argmax())
            drafts.append(y)
        return b, drafts, base, confidence
