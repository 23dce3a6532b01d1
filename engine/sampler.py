"""Batched sampling: one logits row per sequence, each row with its own ``SamplingParams``.

Design choices, and why:

* Every stage works on whole tensors; the only Python loops are over rows (building index lists,
  drawing each seeded row from its own generator), never over the vocabulary.
* Stages no row needs are skipped, so an all-greedy batch costs one ``argmax`` and a plain
  temperature-1 batch costs one softmax plus one multinomial draw.
* Draws are inverse-CDF (``torch.multinomial``): unseeded rows share one call on the shared
  generator; each seeded row is drawn alone from its own generator, so it yields the same tokens
  whatever shares its batch. Filtered tokens just get probability 0.
* Logprobs are taken from the raw logits (before penalties and temperature), as vLLM does, so they
  describe the model rather than the sampling configuration.
* A row whose arithmetic went non-finite (NaN logits after penalties, probabilities that are NaN,
  infinite or all zero) is reported in ``SamplerOutput.failed`` instead of raising: one request's
  sampling parameters must not fail every other request in its batch (issue #17). The checks ride
  on reductions the stages need anyway or on one cheap sum, see ``Sampler._choose``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from engine.outputs import TokenLogprobs
from pagedq_kernels import cpu_ops
from schemas.sampling import SamplingParams

_MASK64 = (1 << 64) - 1
NEG_INF = float("-inf")

# The token a failed row gets. Never a vocabulary id, so a caller that forgot to look at
# ``SamplerOutput.failed`` trips over it (an index error, a detokenizer error) instead of silently
# appending a plausible token.
FAILED_TOKEN = -1

# Reasons for failed rows. They reach the producer as the job's error, so they name the request's own
# parameters and never the batch or the engine's internals.
NAN_LOGITS = "sampling produced NaN logits (check repetition_penalty / frequency_penalty / presence_penalty)"
NO_CANDIDATE = "no token left to choose: every logit is -inf after penalties and min_tokens masking"
NONFINITE_PROBS = "sampling produced non-finite probabilities (check repetition_penalty / temperature)"


def min_tokens_blocked(params: SamplingParams, num_output_tokens: int, constrained: bool) -> str:
    """The reason of a row whose only possible tokens end the output (EOS or a stop token), which
    ``min_tokens`` forbids yet: with a grammar, the grammar must end here (a ``choice`` already
    complete); without one, the model gave every other token -inf."""
    m = params.min_tokens
    plural = "" if m == 1 else "s"
    why = f"min_tokens={m} forbids ending the output short of {m} token{plural} (it has {num_output_tokens})"
    if constrained:
        return f"structured output: the grammar allows only ending here (EOS or a stop token), but {why}"
    return f"no token left to choose: only EOS or stop tokens are possible, but {why}"


@dataclass
class SamplingRow:
    """One logits row's sampling context: its parameters, RNG and the tokens penalties look at."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # Whether a structured-output bitmask was applied to this row (only failure messages read it).
    constrained: bool = False


@dataclass
class GreedyChoice:
    """What a batch of plain greedy rows needs from the logits, computed without them: each row's largest
    logit and the index of its first occurrence (``torch.max(dim=1)``'s answer; NaN when the row has one).
    The model's head returns it where its matmul kernel can (``LlamaForCausalLM.compute_greedy``): the
    logits of a decode step are rows x vocab fp32, written and read back for this answer alone."""

    values: torch.Tensor  # float32 [rows]
    indices: torch.Tensor  # int64 [rows]

    @property
    def shape(self) -> tuple[int, int]:
        """``(rows, 0)``: the batch's row count, as a logits tensor's first dimension gives it."""
        return (int(self.indices.shape[0]), 0)

    def __getitem__(self, rows: slice | torch.Tensor) -> GreedyChoice:
        return GreedyChoice(self.values[rows], self.indices[rows])


def plain_greedy(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether a row of these params is sampled from the argmax alone (:class:`GreedyChoice` serves it):
    greedy, no penalties or logit_bias (they rewrite the logits), no logprobs (they read them), and past ``min_tokens``
    (before it, EOS and the stop tokens are masked out of the logits first)."""
    return (
        params.greedy
        and not params.has_penalties
        and params.logit_bias is None
        and params.logprobs is None
        and (num_output_tokens >= params.min_tokens)
    )


@dataclass
class SamplerOutput:
    """The sampled token per row, and its logprobs where the row's params asked for them.

    ``failed`` maps a row index to a short, user-safe reason when that row could not be sampled; the
    row's token is then ``FAILED_TOKEN`` and its logprobs None. Failing a row rather than raising keeps
    the batch's other rows (the other requests) going.
    """

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    failed: dict[int, str] = field(default_factory=dict)


def _splitmix64(x: int) -> int:
    """A 64-bit mixing function: turns (seed, index) pairs into well-spread, distinct seeds."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def make_generator(seed: int | None, index: int = 0, device: torch.device | str = "cpu") -> torch.Generator | None:
    """The generator for sample ``index`` of a request with ``seed``; None for unseeded requests.

    Sample 0 uses ``seed`` itself, so an ``n=1`` request matches plain ``torch.manual_seed(seed)``
    semantics; other samples get a seed derived by mixing ``(seed, index)``, so the ``n`` samples of a
    seeded request differ from each other yet are each reproducible. ``device`` should be the device
    the logits live on, so noise is drawn there without a host copy.
    """
    if seed is None:
        return None
    derived = seed & _MASK64 if index == 0 else _splitmix64((seed & _MASK64) ^ _splitmix64(index))
    gen = torch.Generator(device=device)
    gen.manual_seed(derived)
    return gen


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """Stack ragged id lists into a [R, max_len] int64 tensor, padded with ``pad`` (one host copy)."""
    width = max(max((len(r) for r in rows), default=0), 1)
    flat = [ids + [pad] * (width - len(ids)) for ids in rows]
    return torch.tensor(flat, dtype=torch.long).to(device, non_blocking=True)


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Apply repetition, frequency and presence penalties to ``logits`` [R, V] in place.

    Token occurrence is built by scattering padded id tensors into a [R, V + 1] table whose extra
    column absorbs padding (and any out-of-range id), so no row needs a Python loop over its tokens.
    Repetition follows transformers (over prompt + output): positive logits are divided by the
    penalty, the others multiplied. Frequency/presence follow OpenAI (over output only):
    ``logit -= frequency * count + presence * (count > 0)``.
    """
    num_rows, vocab = logits.shape
    device = logits.device

    def clean(ids: torch.Tensor) -> torch.Tensor:
        return torch.where((ids >= 0) & (ids < vocab), ids, vocab)

    out_ids = clean(_padded([r.output_token_ids for r in rows], vocab, device))
    counts = torch.zeros((num_rows, vocab + 1), dtype=logits.dtype, device=device)
    counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=logits.dtype))
    counts = counts[:, :vocab]

    rep = [r.params.repetition_penalty for r in rows]
    if any(p != 1.0 for p in rep):
        prompt_ids = clean(_padded([r.prompt_token_ids for r in rows], vocab, device))
        seen = torch.zeros((num_rows, vocab + 1), dtype=torch.bool, device=device)
        seen.scatter_(1, prompt_ids, True)
        seen = seen[:, :vocab] | (counts > 0)
        penalty = torch.tensor(rep, dtype=logits.dtype, device=device).unsqueeze(1).expand_as(logits)
        scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits.copy_(torch.where(seen, scaled, logits))

    freq = [r.params.frequency_penalty for r in rows]
    pres = [r.params.presence_penalty for r in rows]
    if any(f != 0.0 for f in freq) or any(p != 0.0 for p in pres):
        freq_t = torch.tensor(freq, dtype=logits.dtype, device=device).unsqueeze(1)
        pres_t = torch.tensor(pres, dtype=logits.dtype, device=device).unsqueeze(1)
        logits -= freq_t * counts + pres_t * (counts > 0).to(logits.dtype)


def apply_logit_bias(logits: torch.Tensor, row_idx: list[int], rows: list[SamplingRow]) -> None:
    """Add each listed row's ``logit_bias`` to its logits in place: one scatter for the whole batch (OpenAI's
    semantics: -100 all but bans a token, +100 all but forces it; a -inf logit stays -inf)."""
    flat_rows: list[int] = []
    flat_tokens: list[int] = []
    flat_bias: list[float] = []
    for i in row_idx:
        bias = rows[i].params.logit_bias or {}
        flat_rows.extend([i] * len(bias))
        flat_tokens.extend(bias.keys())
        flat_bias.extend(bias.values())
    device = logits.device
    index = (torch.tensor(flat_rows, device=device), torch.tensor(flat_tokens, device=device))
    logits.index_put_(index, torch.tensor(flat_bias, dtype=logits.dtype, device=device), accumulate=True)


def apply_top_k(logits: torch.Tensor, top_k: list[int]) -> None:
    """Keep each row's ``k`` largest logits (ties at the k-th value kept); k <= 0 means off."""
    vocab = logits.shape[1]
    ks = [k if 0 < k < vocab else 0 for k in top_k]
    kmax = max(ks)
    if kmax == 0:
        return
    device = logits.device
    values = torch.topk(logits, kmax, dim=1).values
    k_idx = torch.tensor([max(k, 1) - 1 for k in ks], dtype=torch.long, device=device).unsqueeze(1)
    kth = values.gather(1, k_idx)
    active = torch.tensor([k > 0 for k in ks], dtype=torch.bool, device=device).unsqueeze(1)
    logits.masked_fill_(active & (logits < kth), float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: list[float]) -> None:
    """Keep the smallest set of most likely tokens whose probability mass reaches ``p`` (per row).

    Only rows with ``p < 1`` are sorted: sorting is the most expensive stage and a no-op otherwise.
    A token is dropped when the mass strictly before it already reaches ``p``, so the top token is
    always kept.
    """
    idx = [i for i, p in enumerate(top_p) if p < 1.0]
    if not idx:
        return
    device = logits.device
    sel = torch.tensor(idx, dtype=torch.long, device=device)
    sub = logits.index_select(0, sel)
    probs = torch.softmax(sub, dim=1)
    sorted_probs, order = torch.sort(probs, dim=1, descending=True, stable=True)
    mass_before = torch.cumsum(sorted_probs, dim=1) - sorted_probs
    p = torch.tensor([top_p[i] for i in idx], dtype=probs.dtype, device=device).unsqueeze(1)
    drop_sorted = mass_before >= p
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    logits[sel] = sub.masked_fill(drop, float("-inf"))


class Sampler:
    """Turns a batch of logits into one token per row, honouring each row's ``SamplingParams``.

    ``eos_token_ids`` are the tokens ``min_tokens`` must suppress (together with each row's
    ``stop_token_ids``). ``generator`` is the RNG shared by unseeded rows (the torch default RNG when
    None).
    """

    def __init__(self, eos_token_ids: set[int], generator: torch.Generator | None = None) -> None:
        self.eos_token_ids = set(eos_token_ids)
        self.generator = generator

    def sample(self, logits: torch.Tensor | GreedyChoice, rows: list[SamplingRow]) -> SamplerOutput:
        """Sample one token per row of ``logits`` [M, V]; ``rows[i]`` describes row ``i``. A
        :class:`GreedyChoice` stands for the logits of rows that are all :func:`plain_greedy`.

        Stage order: penalties -> logit_bias -> min_tokens masking -> greedy argmax -> temperature -> top-k -> top-p
        -> min-p -> multinomial draw. ``logits`` is not modified. A row that cannot be sampled (see
        ``_choose``) is reported in ``failed`` rather than raising.
        """
        if isinstance(logits, GreedyChoice):
            return self._greedy_choice(logits, rows)
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits shape {tuple(logits.shape)} does not match {len(rows)} rows")
        x = logits.float()
        pen_idx = [i for i, r in enumerate(rows) if r.params.has_penalties]
        biased = [i for i, r in enumerate(rows) if r.params.logit_bias]
        ban_rows, ban_toks = self._min_tokens_bans(rows, x.shape[1])
        if (pen_idx or biased or ban_rows) and x is logits:
            x = x.clone()  # never modify the caller's logits (.float() already copied non-fp32 input)

        if pen_idx:
            sel = torch.tensor(pen_idx, dtype=torch.long, device=x.device)
            sub = x.index_select(0, sel)
            apply_penalties(sub, [rows[i] for i in pen_idx])
            x[sel] = sub
        if biased:
            apply_logit_bias(x, biased, rows)
        if ban_rows:
            rows_t = torch.tensor(ban_rows, dtype=torch.long, device=x.device)
            toks_t = torch.tensor(ban_toks, dtype=torch.long, device=x.device)
            x[rows_t, toks_t] = float("-inf")

        token_ids, failed = self._choose(x, rows)
        if failed and ban_rows:
            self._name_min_tokens_failures(logits, rows, ban_rows, ban_toks, failed)
        logprobs = self._logprobs(logits, rows, token_ids, failed)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs, failed=failed)

    @staticmethod
    def _greedy_choice(choice: GreedyChoice, rows: list[SamplingRow]) -> SamplerOutput:
        """:meth:`sample` for plain greedy rows from their argmax: the same tokens, and the same failures
        (NaN, or nothing above -inf), as the argmax over the logits gives."""
        if choice.indices.shape[0] != len(rows):
            raise ValueError(f"{choice.indices.shape[0]} greedy choices do not match {len(rows)} rows")
        if not all(plain_greedy(r.params, len(r.output_token_ids)) for r in rows):
            raise ValueError("a greedy choice stands only for plain greedy rows (no penalties, logprobs or bans)")
        values = choice.values.tolist()
        token_ids = [int(t) for t in choice.indices.tolist()]
        failed: dict[int, str] = {}
        for i, value in enumerate(values):
            if not value > float("-inf"):  # False for NaN and -inf
                token_ids[i] = FAILED_TOKEN
                failed[i] = NAN_LOGITS if math.isnan(value) else NO_CANDIDATE
        return SamplerOutput(token_ids=token_ids, logprobs=[None] * len(rows), failed=failed)

    def _min_tokens_bans(self, rows: list[SamplingRow], vocab: int) -> tuple[list[int], list[int]]:
        """(row, token) pairs to set to -inf: EOS and stop tokens of rows short of ``min_tokens``.

        ``ignore_eos`` only changes whether EOS stops a sequence, not this masking.
        """
        ban_rows: list[int] = []
        ban_toks: list[int] = []
        for i, r in enumerate(rows):
            if len(r.output_token_ids) < r.params.min_tokens:
                banned = [t for t in self.eos_token_ids.union(r.params.stop_token_ids) if 0 <= t < vocab]
                ban_rows.extend([i] * len(banned))
                ban_toks.extend(banned)
        return ban_rows, ban_toks

    @staticmethod
    def _name_min_tokens_failures(
        raw: torch.Tensor, rows: list[SamplingRow], ban_rows: list[int], ban_toks: list[int], failed: dict[int, str]
    ) -> None:
        """Give a failed row whose ``min_tokens`` bans removed its last candidates the reason that says so
        (NO_CANDIDATE and NONFINITE_PROBS name penalties or nothing). That is the case when its logits as
        given (a grammar's bitmask applied, nothing else) are free of NaN and every token above -inf is
        banned: a ``choice`` that is already complete, with ``min_tokens`` still ahead. Runs only for
        failed rows with bans, so the usual step pays nothing."""
        banned: dict[int, list[int]] = {}
        for i, t in zip(ban_rows, ban_toks, strict=True):
            if i in failed:
                banned.setdefault(i, []).append(t)
        for i, toks in banned.items():
            row = raw[i].float()
            if bool(torch.isnan(row).any()):
                continue  # NaN logits are their own reason
            possible = row > NEG_INF
            if not bool(possible.any()):
                continue  # nothing was possible even before the bans
            possible[torch.tensor(toks, dtype=torch.long, device=row.device)] = False
            if not bool(possible.any()):
                r = rows[i]
                failed[i] = min_tokens_blocked(r.params, len(r.output_token_ids), r.constrained)

    def _choose(self, x: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], dict[int, str]]:
        """Greedy rows take the argmax; the others go through the filters and a multinomial draw.

        Returns the tokens and the failed rows. A greedy row fails when its maximum is NaN or -inf
        (nothing left to choose): ``max`` propagates NaN, so the argmax pass itself finds it (on the CPU
        :func:`pagedq_kernels.cpu_ops.max_rows`, the same answer in one C pass per row: 0.26 against torch's
        1.17 ms at 64 x 49152 on 2 threads), where a separate ``isnan().any(dim=1)`` pass would add 2.7 ms. A
        sampled row fails when its probabilities do not sum to a finite positive number: softmax
        turns a NaN, an overflow to inf or an all -inf row into NaN, and one sum per row finds any of
        them (0.13 ms). Whole sample() calls at 32 x 49152 on one CPU thread, before -> after the
        guard (medians of interleaved runs): all greedy 2.5 -> 2.0 ms, temperature 1 51-56 ms either
        way (within +-1 %, the multinomial draw is the bulk), half greedy half top-p within +-1 %.
        Failed rows are not drawn, so ``torch.multinomial`` (which raises on such rows on the CPU,
        and may assert on the device) never sees them.
        """
        num_rows = len(rows)
        sample_idx = [i for i, r in enumerate(rows) if not r.params.greedy]
        failed: dict[int, str] = {}
        chosen: torch.Tensor | None = None
        if len(sample_idx) < num_rows:
            best, chosen = cpu_ops.max_rows(x)  # x.max(dim=1); one C pass per row on the CPU
            chosen = torch.where(best > float("-inf"), chosen, FAILED_TOKEN)  # False for NaN and -inf
        if not sample_idx:
            assert chosen is not None
            token_ids = [int(t) for t in chosen.tolist()]
            self._greedy_failures(x, token_ids, range(num_rows), failed)
            return token_ids, failed

        device = x.device
        params = [rows[i].params for i in sample_idx]
        sel = torch.tensor(sample_idx, dtype=torch.long, device=device)
        y = x.index_select(0, sel)
        temps = [p.temperature for p in params]
        if any(t != 1.0 for t in temps):
            y /= torch.tensor(temps, dtype=y.dtype, device=device).unsqueeze(1)
        apply_top_k(y, [p.top_k for p in params])
        apply_top_p(y, [p.top_p for p in params])
        probs = torch.softmax(y, dim=1)
        min_p = [p.min_p for p in params]
        if any(m > 0.0 for m in min_p):
            threshold = torch.tensor(min_p, dtype=probs.dtype, device=device).unsqueeze(1)
            threshold = threshold * probs.max(dim=1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)

        total = probs.sum(dim=1)
        usable = ((total > 0) & torch.isfinite(total)).tolist()
        unusable = [j for j, ok in enumerate(usable) if not ok]
        if unusable:
            # Any valid distribution will do: the draw is discarded, and the row stays in the shared
            # call so the unseeded rows' draws do not shift.
            bad = torch.tensor(unusable, dtype=torch.long, device=device)
            probs[bad] = 0.0
            probs[bad, 0] = 1.0
            for j in unusable:
                failed[sample_idx[j]] = NONFINITE_PROBS
        generators = [rows[i].generator for i in sample_idx]
        sampled = self._multinomial(probs, generators, skip=set(unusable))
        if chosen is None:
            token_ids = [int(t) for t in sampled.tolist()]
        else:
            chosen[sel] = sampled
            token_ids = [int(t) for t in chosen.tolist()]
            sampled_set = set(sample_idx)
            self._greedy_failures(x, token_ids, (i for i in range(num_rows) if i not in sampled_set), failed)
        for i in failed:
            token_ids[i] = FAILED_TOKEN
        return token_ids, failed

    @staticmethod
    def _greedy_failures(
        x: torch.Tensor, token_ids: list[int], greedy_rows: Iterable[int], failed: dict[int, str]
    ) -> None:
        """Name the reason of each greedy row marked ``FAILED_TOKEN``: NaN logits, or all -inf. Reads
        the rows only when one failed, so the usual step pays nothing here."""
        for i in greedy_rows:
            if token_ids[i] == FAILED_TOKEN:
                failed[i] = NAN_LOGITS if bool(torch.isnan(x[i]).any()) else NO_CANDIDATE

    def _multinomial(
        self, probs: torch.Tensor, generators: list[torch.Generator | None], skip: set[int]
    ) -> torch.Tensor:
        """One draw per row: seeded rows from their own generator (so a seeded request's tokens never
        depend on its batch), the rest from the shared one in a single call. Inverse-CDF sampling
        needs one uniform number per row, where a Gumbel/exponential race needs one per vocabulary
        entry: at a 49k vocabulary that random-number generation cost more than the model's head.
        Seeded rows in ``skip`` (failed ones) are not drawn, and their output is ``FAILED_TOKEN``."""
        device = probs.device
        out = torch.full((probs.shape[0],), FAILED_TOKEN, dtype=torch.long, device=device)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if unseeded:
            idx = torch.tensor(unseeded, dtype=torch.long, device=device)
            part = probs if len(unseeded) == len(generators) else probs.index_select(0, idx)
            out[idx] = torch.multinomial(part, 1, generator=self.generator).squeeze(1).to(device)
        for i, gen in enumerate(generators):
            if gen is not None and i not in skip:
                row = probs[i].to(gen.device)  # a CPU generator draws on the CPU
                out[i] = torch.multinomial(row, 1, generator=gen).to(device)[0]
        return out

    @staticmethod
    def _logprobs(
        raw: torch.Tensor, rows: list[SamplingRow], token_ids: list[int], failed: dict[int, str]
    ) -> list[TokenLogprobs | None]:
        """Sampled-token logprob and top-N alternatives from ``log_softmax`` of the raw logits (none for
        failed rows: they sampled nothing)."""
        result: list[TokenLogprobs | None] = [None] * len(rows)
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None and i not in failed]
        if not want:
            return result
        device = raw.device
        sel = torch.tensor(want, dtype=torch.long, device=device)
        lp = torch.log_softmax(raw.index_select(0, sel).float(), dim=1)
        picked = torch.tensor([token_ids[i] for i in want], dtype=torch.long, device=device)
        picked_lp = lp.gather(1, picked.unsqueeze(1)).squeeze(1).tolist()
        top_n = max(rows[i].params.logprobs or 0 for i in want)
        top_vals: list[list[float]] = []
        top_ids: list[list[int]] = []
        if top_n > 0:
            top = torch.topk(lp, min(top_n, lp.shape[1]), dim=1)
            top_vals, top_ids = top.values.tolist(), top.indices.tolist()
        for j, i in enumerate(want):
            n = rows[i].params.logprobs or 0
            # Tokens a structured-output bitmask ruled out have logprob -inf: they are no alternatives
            # (and -inf is not JSON), so the top list may be shorter than asked.
            pairs = [(t, v) for t, v in zip(top_ids[j][:n], top_vals[j][:n], strict=True) if v > NEG_INF] if n else []
            result[i] = TokenLogprobs(token_id=token_ids[i], logprob=float(picked_lp[j]), top=pairs)
        return result
