"""Token selection: sampling parameters, the distribution sampled from, exact sampling, logprobs, and
lossless speculative verification (DSV4-REFERENCE §5.3), all on fp32 logits rows [..., V].

Every tensor step is fixed-shape (sort, gather, scatter, cumsum, three-argument where): boolean-mask
indexing lowers to a dynamic-shape Nonzero / index_put on the Ascend AI-CPU and killed an engine under
speculative decoding (PORTING-LESSONS L12, B20). The host reads are deliberate and declared to the
capability guard with `allow`: one `.tolist()` per verification round, one for prompt logprobs.
Text-side stop handling lives in lib/engine/stops.py. This module must not know the model, the engine's
scheduling or KV state, tokenizers, or any backend by name: it chooses tokens from the logits it is given.
"""
from __future__ import annotations

from typing import NamedTuple

import msgspec
import torch

from lib.guard.capability import allow

MAX_LOGPROBS = 20                      # OpenAI's limit for `top_logprobs`
_GOLDEN = 0x9E3779B97F4A7C15           # odd 64-bit constant: spreads request indices across seed space
_TINY = torch.finfo(torch.float32).tiny


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    max_tokens: int = 16
    temperature: float = 0.0           # 0 = greedy (argmax, ties -> lowest id)
    top_p: float = 1.0                 # nucleus mass in (0, 1]; 1 = off
    top_k: int = 0                     # 0 or -1 = off
    seed: int | None = None            # None = a fresh random seed per request
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None        # number of top alternatives per generated token, 0..20
    prompt_logprobs: int | None = None  # number of top alternatives per prompt token, 0..20
    keep_markup: bool = False          # keep </think> and DSML markers in the text (chat parses them)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int) -> SamplingParams:
        """Raise ValueError naming the field and its accepted range; return self for chaining."""
        def bad(field: str, accepted: str):
            raise ValueError(f"{field}={getattr(self, field)!r} is out of range (accepted: {accepted})")
        # `not (lo <= x <= hi)` rather than `x < lo or x > hi`: NaN fails every comparison and must be refused.
        if not self.max_tokens >= 1:
            bad("max_tokens", ">= 1")
        if not 0.0 <= self.temperature <= 2.0:
            bad("temperature", "0 <= temperature <= 2; 0 is greedy")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "0 < top_p <= 1")
        if not -1 <= self.top_k <= vocab_size:
            bad("top_k", f"-1 <= top_k <= {vocab_size} (the vocab size); 0 and -1 disable it")
        for field in ("logprobs", "prompt_logprobs"):
            value = getattr(self, field)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                bad(field, f"None or 0..{MAX_LOGPROBS}")
        if not all(0 <= t < vocab_size for t in self.stop_token_ids):
            bad("stop_token_ids", f"token ids in 0..{vocab_size - 1}")
        if not all(self.stop):  # an empty stop string would match before the first character
            bad("stop", "non-empty strings")
        return self


def make_generator(seed: int | None, request_index: int) -> torch.Generator:
    """A CPU generator for one request. Seeded: reproducible, and distinct per `request_index` (the n
    choices of one request) with index 0 seeded by `seed` itself. Unseeded: a fresh non-deterministic seed."""
    generator = torch.Generator(device="cpu")
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed((seed + request_index * _GOLDEN) % 2**64)
    return generator


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution actually sampled from, fp32 [..., V] like `logits`: temperature, then top-k, then
    top-p, renormalised. Temperature 0 gives the one-hot of argmax. Ties at the top-k / top-p boundary go
    to the lower id (stable sort), so top_k=1 is exactly greedy."""
    logits = logits.float()  # no-op (no dispatch) for fp32
    if params.greedy:
        return _one_hot(logits.argmax(-1), logits.shape[-1])
    scaled = logits / params.temperature
    vocab = logits.shape[-1]
    top_k = params.top_k if 0 < params.top_k < vocab else 0
    if top_k == 0 and params.top_p >= 1.0:
        return torch.softmax(scaled, -1)
    # Filters are positional in the sorted domain, then scattered back: no data-dependent shapes.
    ordered, order = torch.sort(scaled, dim=-1, descending=True, stable=True)  # [..., V] each
    if top_k:
        in_top_k = torch.arange(vocab, device=logits.device) < top_k             # [V]
        ordered = torch.where(in_top_k, ordered, float("-inf"))
    if params.top_p < 1.0:
        probs = torch.softmax(ordered, -1)
        mass_before = probs.cumsum(-1) - probs   # exactly 0 at position 0, so the top token always stays
        in_nucleus = mass_before < params.top_p  # [..., V]: the smallest prefix whose mass reaches top_p
        ordered = torch.where(in_nucleus, ordered, float("-inf"))
    return torch.zeros_like(ordered).scatter(-1, order, torch.softmax(ordered, -1))


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Ids [...] int64, exactly distributed as `probs` [..., V] (rows need not be normalised): the exponential
    race argmax(p / E), E ~ Exp(1). A one-hot row returns its id whatever the noise."""
    noise = torch.empty(probs.shape, device=generator.device).exponential_(generator=generator)
    # Exp(1) can round to 0 (-log1p(-u) with u == 0); 0/0 is NaN and argmax would pick a zero-probability id.
    noise = noise.clamp_min(_TINY).to(probs.device)
    return (probs / noise).argmax(-1)


class TokenLogprobs(NamedTuple):
    logprob: torch.Tensor       # [R] fp32, the chosen token under log_softmax(raw logits)
    rank: torch.Tensor          # [R] int64, 1-based: 1 + how many ids have a strictly larger logprob
    top_ids: torch.Tensor       # [R, top] int64, best first
    top_logprobs: torch.Tensor  # [R, top] fp32


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, top: int) -> TokenLogprobs:
    """Logprobs of `token_ids` [R] under the model's own distribution (raw logits, temperature 1, as vLLM
    reports by default), their rank, and the `top` best alternatives. Comparison + sum, never a mask index."""
    logp = torch.log_softmax(logits.float(), -1)                          # [R, V]
    chosen = logp.gather(-1, token_ids.long().unsqueeze(-1))              # [R, 1]
    rank = (logp > chosen).sum(-1) + 1
    top_logprobs, top_ids = logp.topk(top, dim=-1)
    return TokenLogprobs(chosen.squeeze(-1), rank, top_ids, top_logprobs)


def prompt_logprobs(logits: torch.Tensor, prompt_ids: torch.Tensor) -> list[float | None]:
    """Per prompt position: None for the first (nothing scores it), else the logprob of prompt_ids[i] under
    logits row i-1 (logits [n, V] from the prefill; its last row scores the first generated token, unused)."""
    chosen = token_logprobs(logits[:-1], prompt_ids[1:], 0).logprob      # [n-1]
    with allow("prompt logprobs go to the host once, after prefill"):
        return [None] + chosen.tolist()


class Verdict(NamedTuple):
    accepted: int       # drafts accepted, 0..L
    tokens: list[int]   # to emit this round: the accepted drafts, then one correction or bonus token


def verify_on_device(target_logits: torch.Tensor, draft_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                     params: SamplingParams, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed-shape part of verification, over any leading batch dims [...]: accept [..., L] bool (each
    draft judged on its own) and candidates [..., L+1] int64 (position j < L: the correction if draft j is
    the first rejected; position L: the bonus). Every candidate is drawn up front so the host needs one read
    per round; an unused candidate's noise is independent of the acceptance uniforms, so the one used keeps
    its exact distribution. Arguments as in `verify`, with the batch dims in front."""
    n_draft, vocab = draft_ids.shape[-1], target_logits.shape[-1]
    if tuple(target_logits.shape[:-1]) != (*draft_ids.shape[:-1], n_draft + 1):
        raise ValueError(f"target_logits has shape {tuple(target_logits.shape)} for draft_ids of shape "
                         f"{tuple(draft_ids.shape)} (need one row per draft + 1)")
    draft_ids = draft_ids.long()
    if params.greedy:  # greedy prefix matching; the candidates are the target's argmax rows
        target_ids = target_logits.argmax(-1)                                   # [..., L+1]
        return draft_ids == target_ids[..., :n_draft], target_ids
    if draft_probs is None:  # a deterministic drafter: its distribution is the one-hot of what it chose
        draft_probs = _one_hot(draft_ids, vocab)
    elif tuple(draft_probs.shape) != (*draft_ids.shape, vocab):
        raise ValueError(f"draft_probs has shape {tuple(draft_probs.shape)}, expected "
                         f"{(*draft_ids.shape, vocab)}")
    p_target = target_probs(target_logits, params)                             # [..., L+1, V]
    p_scored = p_target[..., :n_draft, :]                                      # [..., L, V]: rows with a draft
    p_draft = draft_probs.float()                                              # [..., L, V]
    index = draft_ids.unsqueeze(-1)                                            # [..., L, 1]
    pt_x = p_scored.gather(-1, index).squeeze(-1)                              # [..., L]
    pd_x = p_draft.gather(-1, index).squeeze(-1)                               # [..., L]
    uniform = torch.rand(draft_ids.shape, generator=generator, device=generator.device).to(pt_x.device)
    accept = uniform * pd_x < pt_x        # u < min(1, pt/pd) without dividing; pt == 0 always rejects
    residual = (p_scored - p_draft).clamp_min(0.0)                             # [..., L, V], unnormalised
    # An all-zero residual means p_t == p_d there: rejection cannot happen, but p_t keeps the row samplable.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_scored)
    bonus = p_target[..., n_draft:, :]                                         # [..., 1, V]
    return accept, sample(torch.cat([residual, bonus], -2), generator)         # sample() needs no normalising


def verify_batch(target_logits: torch.Tensor, draft_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                 params: SamplingParams, generator: torch.Generator) -> list[Verdict]:
    """`verify` for B rounds sharing one params and generator: [B, L+1, V], [B, L], [B, L, V] | None.
    One host read for the whole batch."""
    accept, candidates = verify_on_device(target_logits, draft_ids, draft_probs, params, generator)
    n_draft = draft_ids.shape[-1]
    with allow("speculative acceptance is decided on the host: one read per round (DSV4-REFERENCE §5.3)"):
        rows = torch.cat([accept.long(), candidates, draft_ids.long()], -1).tolist()  # [B][3L+1]
    verdicts = []
    for row in rows:
        flags, chosen, drafts = row[:n_draft], row[n_draft:2 * n_draft + 1], row[2 * n_draft + 1:]
        accepted = next((k for k, ok in enumerate(flags) if not ok), n_draft)
        verdicts.append(Verdict(accepted, drafts[:accepted] + [chosen[accepted]]))
    return verdicts


def verify(target_logits: torch.Tensor, draft_ids: torch.Tensor, draft_probs: torch.Tensor | None,
           params: SamplingParams, generator: torch.Generator) -> Verdict:
    """Speculative verification (Leviathan et al., Chen et al.): lossless, the emitted tokens are distributed
    exactly as sampling the target one token at a time.
    target_logits [L+1, V]: row i scores draft position i, row L the bonus; draft_ids [L] int64;
    draft_probs [L, V], the drafter's distributions after the same params (None: a deterministic drafter).
    Draft k is accepted with probability min(1, p_t(x_k)/p_d(x_k)), left to right; the first rejection
    emits a correction from normalize(max(0, p_t - p_d)), else a bonus from p_t's last row.
    Temperature 0 is greedy prefix matching followed by the target's argmax."""
    batched_probs = None if draft_probs is None else draft_probs.unsqueeze(0)
    return verify_batch(target_logits.unsqueeze(0), draft_ids.unsqueeze(0), batched_probs, params, generator)[0]


def _one_hot(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """[..., V] fp32 one-hot rows of `ids` [...]. Not F.one_hot: it range-checks `ids` on the host (a sync)."""
    rows = torch.zeros(*ids.shape, vocab, device=ids.device)
    return rows.scatter(-1, ids.unsqueeze(-1), 1.0)
