"""
Sampling for the serving engine (engine.py): what turns a row's logits into its next token, batched over
the rows of a step, and the acceptance rule of speculative decoding with the MTP block.

What it implements:
- Greedy, temperature, top-k and top-p (nucleus) sampling, each request with its own seeded generator
  (reproducible per seed); OpenAI's presence and frequency penalties over the tokens a request has
  generated (OpenAI's API reference, https://platform.openai.com/docs/api-reference/chat/create; vLLM's
  SamplingParams).
- Batched over the rows (sample, logprobs): the plain greedy rows in one argmax, the logprobs of every row
  that asked in one log_softmax, one host sync for all; a row that samples draws with its own generator.
- Speculative sampling's acceptance rule (Leviathan et al. 2023, https://arxiv.org/abs/2211.17192; Chen
  et al. 2023, https://arxiv.org/abs/2302.01318), used with the MTP block's drafts (GLM-5 report, section
  2; DeepSeek-V3 report, section 2.2): greedy while draft == argmax, else accept with probability
  min(1, p/q) and resample from normalize(max(0, p - q)) at the first rejection, so the output is
  distributed exactly as without drafts.

Run it through engine.py; tests: python -m pytest -q tests/test_engine.py -k "sampl or penal or accept".

Honest limits: penalties count a row's tokens from its Python list at every step (vLLM keeps the counts on
the device); a row that samples (temperature > 0, or penalties) is handled one at a time, only the plain
greedy rows are one batched op; draws happen on the CPU (torch.multinomial with a CPU generator).
"""

import dataclasses

import torch
import torch.nn.functional as F

from dsa import upcast

# -----------------------------------------------------------------------------
# A request's sampling parameters, and the distribution they sample from


@dataclasses.dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int = None
    stop: list = dataclasses.field(default_factory=list)  # stop strings
    logprobs: int = None  # None: no logprobs; n >= 0: the sampled token's logprob and n alternatives
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # subtracted once from every token already generated (-2..2)
    frequency_penalty: float = 0.0  # subtracted per occurrence of a token already generated (-2..2)


def penalize(logits, generated, sp):
    """logits (V,) -> logits less OpenAI's presence and frequency penalties over the tokens this request
    has generated so far (the prompt does not count), before temperature, as OpenAI's API reference and
    vLLM define them: logits[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0).
    The logprobs a request reports stay the model's own, before penalties."""
    logits = upcast(logits)
    if not generated or not (sp.presence_penalty or sp.frequency_penalty):
        return logits
    count = torch.bincount(torch.tensor(generated), minlength=logits.shape[-1]).to(logits)  # (V,)
    return logits - sp.frequency_penalty * count - sp.presence_penalty * (count > 0).to(logits)


def sampling_probs(logits, sp):
    """logits (N, V) -> the distribution (N, V) fp32 that `sp` samples from; one-hot argmax when greedy."""
    logits = upcast(logits)
    if sp.temperature == 0:
        return F.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / sp.temperature
    if sp.top_k and sp.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sp.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sp.top_p < 1.0:
        srt, order = logits.sort(-1, descending=True)
        p = srt.softmax(-1)
        drop = (p.cumsum(-1) - p) > sp.top_p  # keep the smallest head whose mass reaches top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits.softmax(-1)


def penalized(sp):
    return bool(sp.presence_penalty or sp.frequency_penalty)


def draw(probs, gen):
    """One token from probs (V,) with the request's own generator (reproducible per seed)."""
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))


# -----------------------------------------------------------------------------
# Batched over the rows of a step: rows are engine.Request (sp, out: the tokens generated, gen)


def sample(rows, logits):
    """-> each row's token: the plain greedy rows (no penalties) by one batched argmax, the others as
    sampling_probs says (an exception in place of the token if that fails)."""
    plain = [i for i, r in enumerate(rows) if r.sp.temperature == 0 and not penalized(r.sp)]
    tokens = [None] * len(rows)
    if plain:
        picked = logits if len(plain) == len(rows) else logits[plain]
        for i, t in zip(plain, picked.argmax(-1).tolist()):
            tokens[i] = t
    for i, r in enumerate(rows):
        if tokens[i] is not None:
            continue
        try:
            probs = sampling_probs(penalize(logits[i], r.out, r.sp)[None], r.sp)[0]
            tokens[i] = int(probs.argmax()) if r.sp.temperature == 0 else draw(probs, r.gen)
        except Exception as e:  # e.g. a nan temperature: this request fails, not the batch
            tokens[i] = e
    return tokens


def logprobs(rows, logits, tokens):
    """-> {row: (the token's logprob, its top sp.logprobs alternatives as (id, logprob) or None)} for
    the rows that asked, at their temperature and before penalties, all rows in one pass."""
    want = [i for i, r in enumerate(rows) if r.sp.logprobs is not None and isinstance(tokens[i], int)]
    if not want:
        return {}
    temps = torch.tensor([rows[i].sp.temperature or 1.0 for i in want], device=logits.device)
    lp = torch.log_softmax(upcast(logits[want]) / temps.to(upcast(logits).dtype)[:, None], -1)  # (W, V)
    chosen = lp.gather(-1, torch.tensor([[tokens[i]] for i in want], device=lp.device))[:, 0].tolist()
    n = min(max(rows[i].sp.logprobs for i in want), lp.shape[-1])
    top_v, top_ix = torch.topk(lp, n) if n else (lp[:, :0], lp[:, :0].long())
    top_v, top_ix = top_v.tolist(), top_ix.tolist()
    out = {}
    for j, i in enumerate(want):
        k = rows[i].sp.logprobs
        out[i] = (chosen[j], list(zip(top_ix[j][:k], top_v[j][:k])) if k > 0 else None)
    return out


# -----------------------------------------------------------------------------
# The speculative acceptance rule (MTP drafts verified by the main model)


def accept_drafts(p, q, drafts, gen, greedy):
    """Speculative sampling's acceptance rule. p (N + 1, V): the target distributions at the N draft
    positions and one after; q (N, V): the draft distributions; drafts (N,). -> the tokens to append:
    the accepted drafts, then either the correction (at the first rejection) or a bonus token from p[N].
    The output is distributed exactly as p."""
    out = []
    for i, d in enumerate(drafts):
        if greedy:
            if d != int(p[i].argmax()):
                return out + [int(p[i].argmax())]
        elif torch.rand((), generator=gen) >= min(1.0, float(p[i, d] / q[i, d])):
            residual = (p[i] - q[i]).clamp(min=0)
            return out + [draw(residual / residual.sum(), gen)]
        out.append(d)
    if greedy:
        return out + [int(p[-1].argmax())]
    return out + [draw(p[-1], gen)]
